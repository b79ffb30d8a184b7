# Sweep "5d": train_5d.py against the scripts it composes, one table (bench/results/5d.md), each row compared with
# the baseline above it in the same round (harness --baseline). Same model everywhere (L4 H4 h256 T128, global
# batch 16, grad clipping on), 1 thread per rank:
#   - all degrees 1 (1 process) vs train_single: composition should cost nothing (target >= 0.97);
#   - each axis alone at 2 ranks vs its own rung, same flags (target >= 0.95): dp vs train_ddp (bucket), tp and
#     tp + SP vs train_tp, cp vs train_cp (zigzag), pp vs train_pp (1f1b, 8 micro-batches of 2);
#   - dp 2 x tp 2 at 4 ranks vs PyTorch's 2-D composition, FSDP2 over dp + DTensor TP over tp on one DeviceMesh
#     (bench/peer_fsdp2_tp.py, target >= 1.0), with train_5d's ZeRO-1 beside it; model state per rank counted.
# The 1-minute load average is sampled every 10 s while the sweep runs and reported under the table.
# About 4 minutes per round on the shared 2-core machine at STEPS=12 (REPEATS rounds, STEPS steps per run).
# Sourced by bench.sh (harness, STEPS, WARMUP, PYTHON are set there).
FIVED_RUN="OMP_NUM_THREADS=1 $PYTHON -m torch.distributed.run --standalone --nproc_per_node"
FIVED_COMMON="--max_steps $STEPS --warmup_steps 2 --eval_interval 0 --sample_tokens 0 --log_interval 1000 --device cpu --dtype float32 --out_dir {out}"
FIVED_MODEL="--n_layer 4 --n_head 4 --n_embd 256 --block_size 128 --global_batch_size 16"
FIVED_ARGS="$FIVED_MODEL --micro_batch_size 8 $FIVED_COMMON"
FIVED_PP_ARGS="$FIVED_MODEL --micro_batch_size 2 $FIVED_COMMON"     # 8 micro-batches: a pipeline to fill

sample_load bench/runs/5d

harness --name 5d --title "train_5d vs the rungs it composes and vs PyTorch's 2-D composition (L4 H4 h256 T128 B16, 1 thread per rank)" \
  --note "Each row's ratios are to the baseline above it (the row showing 1.00), run in the same round. Targets are judged on the median paired ratio. dp2 x tp2: train_5d's dp axis keeps whole replicas and averages gradients once per step (DDP style); FSDP2 shards parameters, gradients and AdamW moments over dp and gathers each block twice per micro-batch; train_5d's ZeRO-1 shards only the AdamW moments. Peak memory is rank 0's peak RSS (metrics.py: ru_maxrss, runtime included); at dp2 x tp2 every rank holds the same shapes. The peer's comm bytes are its schedule's theory, ours are counted." \
  --baseline "single" --target "5d all 1=0.97" \
  --run "single=OMP_NUM_THREADS=1 $PYTHON train_single.py $FIVED_ARGS" \
  --run "5d all 1=OMP_NUM_THREADS=1 $PYTHON train_5d.py $FIVED_ARGS" \
  --baseline "train_ddp dp2" --target "5d dp2=0.95" \
  --run "train_ddp dp2=$FIVED_RUN 2 train_ddp.py --ddp_mode bucket $FIVED_ARGS" \
  --run "5d dp2=$FIVED_RUN 2 train_5d.py --dp 2 $FIVED_ARGS" \
  --baseline "train_tp tp2" --target "5d tp2=0.95" \
  --run "train_tp tp2=$FIVED_RUN 2 train_tp.py --tp 2 $FIVED_ARGS" \
  --run "5d tp2=$FIVED_RUN 2 train_5d.py --tp 2 $FIVED_ARGS" \
  --baseline "train_tp tp2 sp" --target "5d tp2 sp=0.95" \
  --run "train_tp tp2 sp=$FIVED_RUN 2 train_tp.py --tp 2 --sp $FIVED_ARGS" \
  --run "5d tp2 sp=$FIVED_RUN 2 train_5d.py --tp 2 --sp $FIVED_ARGS" \
  --baseline "train_cp cp2" --target "5d cp2=0.95" \
  --run "train_cp cp2=$FIVED_RUN 2 train_cp.py --cp 2 --cp_layout zigzag $FIVED_ARGS" \
  --run "5d cp2=$FIVED_RUN 2 train_5d.py --cp 2 --cp_layout zigzag $FIVED_ARGS" \
  --baseline "train_pp pp2" --target "5d pp2=0.95" \
  --run "train_pp pp2=$FIVED_RUN 2 train_pp.py --pp 2 --pp_schedule 1f1b $FIVED_PP_ARGS" \
  --run "5d pp2=$FIVED_RUN 2 train_5d.py --pp 2 --pp_schedule 1f1b $FIVED_PP_ARGS" \
  --baseline "FSDP2+DTensor dp2 tp2" --target "5d dp2 tp2=1.0" \
  --run "FSDP2+DTensor dp2 tp2=$FIVED_RUN 4 bench/peer_fsdp2_tp.py --dp 2 --tp 2 $FIVED_ARGS" \
  --run "5d dp2 tp2=$FIVED_RUN 4 train_5d.py --dp 2 --tp 2 $FIVED_ARGS" \
  --run "5d dp2 tp2 ZeRO-1=$FIVED_RUN 4 train_5d.py --dp 2 --tp 2 --zero_stage 1 $FIVED_ARGS"

stop_load
$PYTHON bench/model_state_5d.py --results bench/results/5d.md --load bench/runs/5d/loadavg.txt
