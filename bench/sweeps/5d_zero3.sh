# Sweep "5d_zero3": ZeRO-3 inside train_5d's grid, one table (bench/results/5d_zero3.md), each row compared with
# the baseline above it in the same round (harness --baseline). The model and flags of the 5d sweep (L4 H4 h256
# T128, global batch 16, grad clipping on), 1 thread per rank:
#   - dp 2 x tp 2 with ZeRO-3 at 4 ranks vs PyTorch's 2-D composition, FSDP2 fully_shard over dp + DTensor TP
#     over tp on one DeviceMesh (bench/peer_fsdp2_tp.py): the same algorithm (parameters, gradients and AdamW
#     moments sharded over dp, each block gathered before its forward and its backward), target >= 1.0;
#   - dp 2 with ZeRO-3 at 2 ranks vs train_zero --zero_stage 3 on the same ranks: what the grid costs, >= 0.95.
# Model state per rank is counted under the table. About 3 minutes per round on the shared 2-core machine at
# STEPS=12. Sourced by bench.sh (harness, STEPS, WARMUP, PYTHON are set there).
Z3_RUN="OMP_NUM_THREADS=1 $PYTHON -m torch.distributed.run --standalone --nproc_per_node"
Z3_ARGS="--n_layer 4 --n_head 4 --n_embd 256 --block_size 128 --global_batch_size 16 --micro_batch_size 8 --max_steps $STEPS --warmup_steps 2 --eval_interval 0 --sample_tokens 0 --log_interval 1000 --device cpu --dtype float32 --out_dir {out}"

sample_load bench/runs/5d_zero3

harness --name 5d_zero3 --title "ZeRO-3 in train_5d's grid vs FSDP2 + DTensor TP and vs train_zero (L4 H4 h256 T128 B16, 1 thread per rank)" \
  --note "Each row's ratios are to the baseline above it (the row showing 1.00), run in the same round. Targets are judged on the median paired ratio. Both dp2 x tp2 runs shard parameters, gradients and AdamW moments over dp and gather each block before its forward and before its backward (train_5d: --reshard_after_forward, its default; FSDP2: reshard_after_forward=True). Peak memory is rank 0's peak RSS (runtime included). The peer's comm bytes are its schedule's theory, ours are counted." \
  --baseline "FSDP2+DTensor dp2 tp2" --target "5d dp2 tp2 ZeRO-3=1.0" \
  --run "FSDP2+DTensor dp2 tp2=$Z3_RUN 4 bench/peer_fsdp2_tp.py --dp 2 --tp 2 $Z3_ARGS" \
  --run "5d dp2 tp2 ZeRO-3=$Z3_RUN 4 train_5d.py --dp 2 --tp 2 --zero_stage 3 $Z3_ARGS" \
  --baseline "train_zero dp2 ZeRO-3" --target "5d dp2 ZeRO-3=0.95" \
  --run "train_zero dp2 ZeRO-3=$Z3_RUN 2 train_zero.py --zero_stage 3 $Z3_ARGS" \
  --run "5d dp2 ZeRO-3=$Z3_RUN 2 train_5d.py --dp 2 --zero_stage 3 $Z3_ARGS"

stop_load
$PYTHON bench/model_state_5d.py --results bench/results/5d_zero3.md --load bench/runs/5d_zero3/loadavg.txt
