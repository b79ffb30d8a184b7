# Sweep "kernels": the fused paths of kernels/ against the plain-torch model, same config, alternating runs.
# Sourced by bench.sh (harness, STEPS, WARMUP, PYTHON are set there).
#  - CPU: train_single --kernels compile (torch.compile'd fusions) vs --kernels torch (eager), and the fused
#    LM head + cross-entropy vs the unfused one at GPT-2's vocabulary (peak working memory and speed);
#  - GPU (only when one is visible): --kernels triton vs --kernels torch, bf16.
K_COMMON="--warmup_steps 2 --eval_interval 0 --sample_tokens 0 --log_interval 1000 --out_dir {out}"
K_CPU="OMP_NUM_THREADS=1 $PYTHON train_single.py --device cpu --dtype float32 --max_steps $STEPS $K_COMMON"
K_MODEL="--n_layer 4 --n_head 4 --n_embd 128 --block_size 64 --global_batch_size 12 --micro_batch_size 12"

harness --name kernels_compile \
  --title "train_single --kernels compile vs eager torch, CPU fp32, 1 thread (L4 H4 h128 T64 B12)" \
  --note "compile: each block compiled whole (regional), ln_f and the chunked LM head's row kernel compiled." \
  --run "torch=$K_CPU $K_MODEL --kernels torch" \
  --run "compile=$K_CPU $K_MODEL --kernels compile"

harness --name kernels_lm_head --warmup 1 \
  --title "LM head + cross-entropy, 4096 tokens x h768 x vocab 50304, fp32 CPU, forward + backward" \
  --note "peak memory = the step's working memory above its inputs (resident-set growth); tokens/s of the head alone." \
  --run "unfused=OMP_NUM_THREADS=2 $PYTHON bench/kernels_lm_head.py --head unfused --max_steps 4 --out_dir {out}" \
  --run "fused=OMP_NUM_THREADS=2 $PYTHON bench/kernels_lm_head.py --head fused --max_steps 4 --out_dir {out}"

if $PYTHON -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  K_GPU="$PYTHON train_single.py --device cuda --dtype bfloat16 --max_steps $STEPS $K_COMMON"
  K_GPU_MODEL="--n_layer 12 --n_head 12 --n_embd 768 --block_size 1024 --global_batch_size 16 --micro_batch_size 16"
  harness --name kernels_gpu --title "train_single --kernels triton vs torch, GPU bf16 (GPT-2 small shape, T1024 B16)" \
    --run "torch=$K_GPU $K_GPU_MODEL --kernels torch" \
    --run "triton=$K_GPU $K_GPU_MODEL --kernels triton"
fi
