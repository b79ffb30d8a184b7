# Sweep "zero": train_zero.py's ZeRO-3 side by side with FSDP2 (fully_shard per block, same model, batch and
# loop), prefetch on and off; ZeRO-1 and ZeRO-2 against our DDP. 2 ranks x 1 thread on CPU.
# Sourced by bench.sh (harness, STEPS, WARMUP, PYTHON are set there).
ZERO_RUN="OMP_NUM_THREADS=1 $PYTHON -m torch.distributed.run --standalone --nproc_per_node 2"
ZERO_COMMON="--n_layer 4 --n_head 4 --n_embd 256 --block_size 64 --global_batch_size 16 --micro_batch_size 8 --max_steps $STEPS --warmup_steps 2 --eval_interval 0 --sample_tokens 0 --log_interval 1000 --device cpu --dtype float32 --out_dir {out}"

harness --name zero3_vs_fsdp2 --title "ZeRO-3 vs FSDP2, 2 ranks x 1 thread (L4 H4 h256 T64, B16 = 2 x 8)" \
  --run "FSDP2=$ZERO_RUN bench/peer_fsdp2.py $ZERO_COMMON" \
  --run "ours ZeRO-3 prefetch=$ZERO_RUN train_zero.py --zero_stage 3 --prefetch $ZERO_COMMON" \
  --run "ours ZeRO-3 no prefetch=$ZERO_RUN train_zero.py --zero_stage 3 --no-prefetch $ZERO_COMMON"

harness --name zero12_vs_ddp --title "ZeRO-1 and ZeRO-2 vs our DDP, 2 ranks x 1 thread (L4 H4 h256 T64, B16 = 2 x 8)" \
  --run "ours DDP bucket=$ZERO_RUN train_ddp.py $ZERO_COMMON" \
  --run "ours ZeRO-1=$ZERO_RUN train_zero.py --zero_stage 1 $ZERO_COMMON" \
  --run "ours ZeRO-2=$ZERO_RUN train_zero.py --zero_stage 2 $ZERO_COMMON"
