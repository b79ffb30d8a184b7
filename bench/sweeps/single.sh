# Sweep "single": train_single.py at nanoGPT's README CPU config and at a compute-bound config.
# With NANOGPT_DIR pointing at a nanoGPT checkout, nanoGPT's own train.py runs as the peer (same model shape,
# same tokens per step, fp32, no compile, one thread each); without it, ours runs alone.
# Sourced by bench.sh (harness, STEPS, WARMUP, PYTHON are set there).
single_row() {  # name, title, model/batch flags
  local name=$1 title=$2 flags=$3
  local ours="ours=OMP_NUM_THREADS=1 $PYTHON train_single.py $flags --max_steps $STEPS --warmup_steps 2 --eval_interval 0 --sample_tokens 0 --log_interval 1000 --device cpu --dtype float32 --out_dir {out}"
  if [ -n "${NANOGPT_DIR:-}" ]; then
    harness --name "$name" --title "$title" \
      --run "nanoGPT=OMP_NUM_THREADS=1 $PYTHON bench/peer_nanogpt.py --nanogpt_dir $NANOGPT_DIR $flags --max_steps $STEPS --out_dir {out}" \
      --run "$ours"
  else
    harness --name "$name" --title "$title" --run "$ours"
  fi
}
single_row single_tiny "train_single vs nanoGPT, nanoGPT's CPU config (L4 H4 h128 T64 B12), 1 thread" \
  "--n_layer 4 --n_head 4 --n_embd 128 --block_size 64 --global_batch_size 12 --micro_batch_size 12"
single_row single_compute "train_single vs nanoGPT, compute-bound config (L6 H6 h384 T256 B8), 1 thread" \
  "--n_layer 6 --n_head 6 --n_embd 384 --block_size 256 --global_batch_size 8 --micro_batch_size 8"
# the same two shapes, model + optimizer only, one step at a time in one process (resolves ~1% differences)
if [ -n "${NANOGPT_DIR:-}" ]; then
  $PYTHON bench/nanogpt_step_ab.py --name single_tiny_steps --n_layer 4 --n_head 4 --n_embd 128 --block_size 64 \
    --batch_size 12 --steps 300
  $PYTHON bench/nanogpt_step_ab.py --name single_compute_steps --n_layer 6 --n_head 6 --n_embd 384 \
    --block_size 256 --batch_size 8 --steps 30 --warmup 3
fi
