# Sweep "tp": tensor parallelism. Table tp: train_tp.py at tp=2 (2 ranks x 1 thread) side by side with PyTorch's
# DTensor parallelize_module (bench/peer_tp_dtensor.py, the same model, batch and loop), with and without SP.
# Table tp_memory: activation bytes per rank, counted (train_tp logs act_bytes: what autograd keeps for backward
# in one micro-batch's forward, parameters excluded), single device vs tp=2 vs tp=2 + SP, and tokens/s.
# Sourced by bench.sh (harness, STEPS, WARMUP, PYTHON are set there).
TP_RUN="OMP_NUM_THREADS=1 $PYTHON -m torch.distributed.run --standalone --nproc_per_node 2"
TP_COMMON="--max_steps $STEPS --warmup_steps 2 --grad_clip 0 --eval_interval 0 --sample_tokens 0 --log_interval 1000 --device cpu --dtype float32 --out_dir {out}"
TP_MODEL="--n_layer 4 --n_head 4 --n_embd 256 --block_size 128 --global_batch_size 8 --micro_batch_size 8"

harness --name tp --title "train_tp vs DTensor parallelize_module, tp=2 (2 ranks x 1 thread), L4 H4 h256 T128 B8" \
  --note "Both split attention by heads and the MLP column-then-row. train_tp also splits the tied embedding / LM head by vocabulary (vocab-parallel cross-entropy); the DTensor peer keeps it replicated (see its docstring). --grad_clip 0 in every run (the peer has no global norm over shards). The peer's comm bytes are its plan's theory, ours are counted." \
  --run "DTensor tp2=$TP_RUN bench/peer_tp_dtensor.py --tp 2 $TP_MODEL $TP_COMMON" \
  --run "ours tp2=$TP_RUN train_tp.py --tp 2 $TP_MODEL $TP_COMMON" \
  --run "ours tp2 overlap=$TP_RUN train_tp.py --tp 2 --tp_overlap $TP_MODEL $TP_COMMON" \
  --run "DTensor tp2 sp=$TP_RUN bench/peer_tp_dtensor.py --tp 2 --sp $TP_MODEL $TP_COMMON" \
  --run "ours tp2 sp=$TP_RUN train_tp.py --tp 2 --sp $TP_MODEL $TP_COMMON"

# memory: a few steps are enough, the counted bytes are the same every step
harness --name tp_memory --repeats 1 --warmup 1 \
  --title "train_tp activation bytes per rank (counted): single device, tp=2, tp=2 + SP, L4 H4 h256 T128 B8" \
  --run "tp1=OMP_NUM_THREADS=1 $PYTHON train_tp.py --tp 1 $TP_MODEL ${TP_COMMON/--max_steps $STEPS/--max_steps 3}" \
  --run "tp2=$TP_RUN train_tp.py --tp 2 $TP_MODEL ${TP_COMMON/--max_steps $STEPS/--max_steps 3}" \
  --run "tp2 sp=$TP_RUN train_tp.py --tp 2 --sp $TP_MODEL ${TP_COMMON/--max_steps $STEPS/--max_steps 3}"
$PYTHON - <<'PY'
import json
from model import GPTConfig, activation_bytes_per_layer
from planner.memory import tp_activation_bytes_per_layer
cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)
kw = dict(bytes_per_value=4, recompute="selective", dropout=False)   # fp32; CPU sdpa keeps no T x T scores
rows = {}
for label, tp, sp in (("tp1", 1, False), ("tp2", 2, False), ("tp2_sp", 2, True)):
    with open(f"bench/runs/tp_memory/{label}_0/metrics.jsonl") as f:
        rows[label] = ([json.loads(line) for line in f if '"act_bytes"' in line][-1]["act_bytes"],
                       tp_activation_bytes_per_layer(128, 8, cfg, tp, sp, **kw) / activation_bytes_per_layer(128, 8, cfg, **kw))
lines = ["", "| run | activation bytes per rank | vs tp=1 | Korthikanti (blocks only) |", "|---|---|---|---|"]
lines += [f"| {k} | {b / 2**20:.2f} MiB | {b / rows['tp1'][0]:.3f} | {p:.3f} |" for k, (b, p) in rows.items()]
with open("bench/results/tp_memory.md", "a") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
