# Sweep "bubble": the pipeline bubble by schedule (afab, 1f1b, interleaved, zb1, zbv, dualpipev) at a few (p, m):
# pipeline/schedules.py's formula and simulator, and train_pp.py runs under --profile where p <= the cores here
# (bench/bubble_chart.py -> bench/results/bubble.md and bubble.png). Measured idle moves with the machine's load:
# the table records the load average around the runs. About 1.5 minutes on the shared 2-core machine.
# Sourced by bench.sh (PYTHON is set there).
$PYTHON bench/bubble_chart.py
