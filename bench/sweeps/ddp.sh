# Sweep "ddp": train_ddp.py's three modes side by side with torch DDP (same model, batch and loop), and the
# scaling of 2 ranks x 1 thread over 1 rank x 1 thread on the same per-rank batch.
# Sourced by bench.sh (harness, STEPS, WARMUP, PYTHON are set there).
DDP_RUN="OMP_NUM_THREADS=1 $PYTHON -m torch.distributed.run --standalone --nproc_per_node 2"
DDP_COMMON="--max_steps $STEPS --warmup_steps 2 --eval_interval 0 --sample_tokens 0 --log_interval 1000 --device cpu --dtype float32 --out_dir {out}"
DDP_MODEL="--n_layer 4 --n_head 4 --n_embd 256 --block_size 64"

harness --name ddp_modes --title "train_ddp modes vs torch DDP, 2 ranks x 1 thread (L4 H4 h256 T64, B16 = 2 x 8)" \
  --run "torch DDP=$DDP_RUN bench/peer_torch_ddp.py $DDP_MODEL --global_batch_size 16 --micro_batch_size 8 $DDP_COMMON" \
  --run "ours bucket=$DDP_RUN train_ddp.py --ddp_mode bucket $DDP_MODEL --global_batch_size 16 --micro_batch_size 8 $DDP_COMMON" \
  --run "ours overlap=$DDP_RUN train_ddp.py --ddp_mode overlap $DDP_MODEL --global_batch_size 16 --micro_batch_size 8 $DDP_COMMON" \
  --run "ours naive=$DDP_RUN train_ddp.py --ddp_mode naive $DDP_MODEL --global_batch_size 16 --micro_batch_size 8 $DDP_COMMON"

harness --name ddp_scaling --title "train_ddp scaling: 2 ranks x 1 thread vs 1 rank x 1 thread, 8 sequences per rank" \
  --note "Scaling efficiency = ratio / 2 (two ranks, each with the single run's per-rank batch)." \
  --run "single 1x1=OMP_NUM_THREADS=1 $PYTHON train_single.py $DDP_MODEL --global_batch_size 8 --micro_batch_size 8 $DDP_COMMON" \
  --run "ddp 2x1=$DDP_RUN train_ddp.py $DDP_MODEL --global_batch_size 16 --micro_batch_size 8 $DDP_COMMON"
