# Sweep "scaling": runs nothing; tokens/s by number of ranks read from the tables the ddp sweep (ddp_scaling: 1 and
# 2 ranks, the per-rank batch fixed) and the 5d sweep (train_5d at 1 rank and dp 2, the global batch fixed) wrote,
# as bench/results/scaling.md and scaling.png (bench/scaling_chart.py). Run it after those sweeps.
# Sourced by bench.sh (PYTHON is set there).
SCALING_TABLES=(bench/results/ddp_scaling.md)
[ -f bench/results/5d.md ] && SCALING_TABLES+=("bench/results/5d.md:5d all 1,5d dp2")
$PYTHON bench/scaling_chart.py "${SCALING_TABLES[@]}"
