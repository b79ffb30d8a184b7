# Sweep "pp": train_pp.py's schedules side by side with torch.distributed.pipelining on the same split
# (bench/peer_torch_pipelining.py: same stages, weights, data, optimizer; torch's ScheduleZBVZeroBubble and
# ScheduleDualPipeV for zbv and dualpipev), 2 ranks x 1 thread, m = 8; then
# zb1 vs 1f1b (ours). Below each table: the median share of its pipeline schedule that rank 0 spent waiting for
# messages (idle_frac in metrics.jsonl; optimizer step excluded)
# next to the simulator's bubble for F = B = W (pipeline/schedules.py).
# Sourced by bench.sh (harness, STEPS, WARMUP, PYTHON are set there).
PP_RUN="OMP_NUM_THREADS=1 $PYTHON -m torch.distributed.run --standalone --nproc_per_node 2"
PP_COMMON="--pp 2 --n_layer 4 --n_head 4 --n_embd 256 --block_size 128 --global_batch_size 16 --micro_batch_size 2 --max_steps $STEPS --warmup_steps 2 --eval_interval 0 --sample_tokens 0 --log_interval 1000 --device cpu --dtype float32 --out_dir {out}"

pp_idle() {  # name: append measured idle share (median over runs and steps after WARMUP) to the table
  $PYTHON - "$1" "$WARMUP" <<'PY'
import glob, json, os, statistics, sys
name, warmup = sys.argv[1], int(sys.argv[2])
lines = ["", "| run | measured idle share of the schedule (rank 0) | simulated bubble, F = B = W |", "|---|---|---|"]
for label in sorted({os.path.basename(d).rsplit("_", 1)[0] for d in glob.glob(f"bench/runs/{name}/*_[0-9]*")}):
    rows = [json.loads(l) for d in glob.glob(f"bench/runs/{name}/{label}_[0-9]*") for l in open(f"{d}/metrics.jsonl")]
    rows = [r for r in rows if "idle_frac" in r and r["step"] >= warmup]
    if rows:
        lines.append(f"| {label.replace('_', ' ')} | {statistics.median(r['idle_frac'] for r in rows):.3f} | "
                     f"{rows[0]['bubble_sim']:.3f} |")
with open(f"bench/results/{name}.md", "a") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
}

for sched in afab 1f1b interleaved zbv dualpipev; do   # zbv, dualpipev: 2 chunks per rank in a V
  extra=""; case "$sched" in interleaved|zbv|dualpipev) extra="--pp_virtual 2";; esac
  harness --name "pp_$sched" --title "train_pp $sched vs torch.distributed.pipelining, pp=2 x 1 thread (L4 H4 h256 T128, B16 = 8 x 2)" \
    --run "torch pipelining=$PP_RUN bench/peer_torch_pipelining.py --pp_schedule $sched $extra $PP_COMMON" \
    --run "ours=$PP_RUN train_pp.py --pp_schedule $sched $extra $PP_COMMON"
  pp_idle "pp_$sched"
done

harness --name pp_zb1 --title "train_pp zb1 (ZB-H1) vs 1f1b, pp=2 x 1 thread (L4 H4 h256 T128, B16 = 8 x 2)" \
  --note "zb1 computes each Linear's weight gradient in a separate W pass (deferred into the bubbles)." \
  --run "ours 1f1b=$PP_RUN train_pp.py --pp_schedule 1f1b $PP_COMMON" \
  --run "ours zb1=$PP_RUN train_pp.py --pp_schedule zb1 $PP_COMMON"
pp_idle pp_zb1
