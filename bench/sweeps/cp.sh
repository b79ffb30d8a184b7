# Sweep "cp": context parallelism. Table cp: train_cp.py at cp=2 (2 ranks x 1 thread) in its three layouts vs
# train_single.py (1 thread) on a long-sequence model and the same global batch (2 sequences of 1024 tokens).
# Table cp_memory: activation bytes per rank, counted (train_cp logs act_bytes: the bytes autograd keeps for
# backward in one micro-batch's forward, parameters excluded), at cp = 1, 2, 4; they shrink as 1/cp.
# Sourced by bench.sh (harness, STEPS, WARMUP, PYTHON are set there).
CP_RUN="OMP_NUM_THREADS=1 $PYTHON -m torch.distributed.run --standalone --nproc_per_node"
CP_COMMON="--warmup_steps 2 --eval_interval 0 --sample_tokens 0 --log_interval 1000 --device cpu --dtype float32 --out_dir {out}"
CP_MODEL="--n_layer 4 --n_head 4 --n_embd 128 --block_size 1024 --global_batch_size 2 --micro_batch_size 2"

harness --name cp --title "train_cp cp=2 (2 ranks x 1 thread) vs train_single (1 thread), L4 H4 h128 T1024 B2" \
  --note "Same global batch in every run; each CP rank holds 512 of the 1024 positions. ring: contiguous halves (rank 1 does 3x rank 0's attention); zigzag and allgather: chunks (r, 2cp-1-r), equal work. Both use torch's fused CPU attention kernel (train_cp calls it per block, for out + lse). Bytes/step (counted = theory): ring/zigzag 4 layers x (fwd KV + bwd KV + 2 dKV) = 16 MiB, allgather 4 x 3 = 12 MiB, plus the CP gradient all-reduce 2(cp-1)/cp x 4N = 3.15 MiB." \
  --run "single=OMP_NUM_THREADS=1 $PYTHON train_single.py $CP_MODEL $CP_COMMON --max_steps $STEPS" \
  --run "cp2 ring=$CP_RUN 2 train_cp.py --cp 2 --cp_layout ring $CP_MODEL $CP_COMMON --max_steps $STEPS" \
  --run "cp2 zigzag=$CP_RUN 2 train_cp.py --cp 2 --cp_layout zigzag $CP_MODEL $CP_COMMON --max_steps $STEPS" \
  --run "cp2 allgather=$CP_RUN 2 train_cp.py --cp 2 --cp_layout allgather $CP_MODEL $CP_COMMON --max_steps $STEPS"

# memory: a few steps are enough, the counted bytes are the same every step
harness --name cp_memory --repeats 1 --warmup 1 \
  --title "train_cp activation bytes per rank (counted) at cp = 1, 2, 4 (zigzag), L4 H4 h128 T1024 B2" \
  --run "cp1=OMP_NUM_THREADS=1 $PYTHON train_cp.py --cp 1 --cp_layout zigzag $CP_MODEL $CP_COMMON --max_steps 3" \
  --run "cp2=$CP_RUN 2 train_cp.py --cp 2 $CP_MODEL $CP_COMMON --max_steps 3" \
  --run "cp4=$CP_RUN 4 train_cp.py --cp 4 $CP_MODEL $CP_COMMON --max_steps 3"
$PYTHON - <<'PY'
import json
rows = {}
for cp in (1, 2, 4):
    with open(f"bench/runs/cp_memory/cp{cp}_0/metrics.jsonl") as f:
        rows[cp] = [json.loads(line) for line in f if '"act_bytes"' in line][-1]["act_bytes"]
lines = ["", "| cp | activation bytes per rank | vs cp=1 |", "|---|---|---|"]
lines += [f"| {cp} | {b / 2**20:.2f} MiB | {b / rows[1]:.3f} |" for cp, b in rows.items()]
with open("bench/results/cp_memory.md", "a") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
