# Sweep "pp": train_pp.py's schedules side by side with torch.distributed.pipelining on the same split
# (bench/peer_torch_pipelining.py: same stages, weights, data, optimizer; torch's ScheduleZBVZeroBubble and
# ScheduleDualPipeV for zbv and dualpipev), 2 ranks x 1 thread, m = 8; then interleaved against 1f1b and torch's
# interleaved in one alternating table, at pp 2 and pp 4 (4 ranks on the 2 cores: oversubscribed); then
# zb1 vs 1f1b (ours). Below each table: the median share of its pipeline schedule that rank 0 spent waiting for
# messages (idle_frac in metrics.jsonl; optimizer step excluded) next to the simulator's bubble for F = B = W
# (pipeline/schedules.py) and at the run's own median F:B:W (bubble_sim_run), and the 1-minute load average
# sampled while the table ran.
# Sourced by bench.sh (harness, sample_load, STEPS, WARMUP, PYTHON are set there).
PP_RUN="OMP_NUM_THREADS=1 $PYTHON -m torch.distributed.run --standalone --nproc_per_node 2"
PP_COMMON="--pp 2 --n_layer 4 --n_head 4 --n_embd 256 --block_size 128 --global_batch_size 16 --micro_batch_size 2 --max_steps $STEPS --warmup_steps 2 --eval_interval 0 --sample_tokens 0 --log_interval 1000 --device cpu --dtype float32 --out_dir {out}"

pp_idle() {  # name: append measured idle share (median over runs and steps after WARMUP) to the table
  $PYTHON - "$1" "$WARMUP" <<'PY'
import glob, json, os, statistics, sys
name, warmup = sys.argv[1], int(sys.argv[2])
lines = ["", "| run | measured idle share of the schedule (rank 0) | simulated bubble, F = B = W | simulated at the run's "
         "F:B:W | excess: measured - simulated at the run's F:B:W |", "|---|---|---|---|---|"]
for label in sorted({os.path.basename(d).rsplit("_", 1)[0] for d in glob.glob(f"bench/runs/{name}/*_[0-9]*")}):
    rows = [json.loads(l) for d in glob.glob(f"bench/runs/{name}/{label}_[0-9]*") for l in open(f"{d}/metrics.jsonl")]
    rows = [r for r in rows if "idle_frac" in r and r["step"] >= warmup]
    if rows:
        measured, at_run = (statistics.median(r[k] for r in rows) for k in ("idle_frac", "bubble_sim_run"))
        lines.append(f"| {label.replace('_', ' ')} | {measured:.3f} | {rows[0]['bubble_sim']:.3f} | {at_run:.3f} | "
                     f"{measured - at_run:+.3f} |")
load = [float(x) for x in open(f"bench/runs/{name}/loadavg.txt").read().split()] or [os.getloadavg()[0]]
lines += ["", f"1-minute load average while the table ran (every 10 s): median {statistics.median(load):.1f}, range "
          f"{min(load):.1f}-{max(load):.1f}, the table's own ranks included."]
with open(f"bench/results/{name}.md", "a") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
}

pp_table() {  # NAME, then harness arguments: one alternating table, the load sampled meanwhile, then its idle shares
  local name=$1; shift
  sample_load "bench/runs/$name"
  harness --name "$name" "$@"
  stop_load
  pp_idle "$name"
}

for sched in afab 1f1b interleaved zbv dualpipev; do   # zbv, dualpipev: 2 chunks per rank in a V
  extra=""; case "$sched" in interleaved|zbv|dualpipev) extra="--pp_virtual 2";; esac
  pp_table "pp_$sched" --title "train_pp $sched vs torch.distributed.pipelining, pp=2 x 1 thread (L4 H4 h256 T128, B16 = 8 x 2)" \
    --run "torch pipelining=$PP_RUN bench/peer_torch_pipelining.py --pp_schedule $sched $extra $PP_COMMON" \
    --run "ours=$PP_RUN train_pp.py --pp_schedule $sched $extra $PP_COMMON"
done

for pp in 2 4; do   # interleaved (v = 2) against our 1f1b and torch's interleaved, alternating in one table
  run="OMP_NUM_THREADS=1 $PYTHON -m torch.distributed.run --standalone --nproc_per_node $pp"
  args="${PP_COMMON/--pp 2 --n_layer 4/--pp $pp --n_layer $((2 * pp))}"
  pp_table "pp${pp}_interleaved_1f1b" --title "train_pp interleaved vs 1f1b vs torch.distributed.pipelining's interleaved, pp=$pp x 1 thread (L$((2 * pp)) H4 h256 T128, B16 = 8 x 2)" \
    --run "torch interleaved=$run bench/peer_torch_pipelining.py --pp_schedule interleaved --pp_virtual 2 $args" \
    --run "ours interleaved=$run train_pp.py --pp_schedule interleaved --pp_virtual 2 $args" \
    --run "ours 1f1b=$run train_pp.py --pp_schedule 1f1b $args"
done

pp_table pp_zb1 --title "train_pp zb1 (ZB-H1) vs 1f1b, pp=2 x 1 thread (L4 H4 h256 T128, B16 = 8 x 2)" \
  --note "zb1 computes each Linear's weight gradient in a separate W pass (deferred into the bubbles)." \
  --run "ours 1f1b=$PP_RUN train_pp.py --pp_schedule 1f1b $PP_COMMON" \
  --run "ours zb1=$PP_RUN train_pp.py --pp_schedule zb1 $PP_COMMON"
