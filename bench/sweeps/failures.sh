# Sweep "failures": the failure battery (bench/failure_battery.py), not a timing sweep. About 460 cases of
# bad input and bad luck over every script, each classified (clean error, ok, skipped; or traceback, hang, silent
# wrong, data lost, unclear error, refused): the table goes to bench/results/failures.md. About 40 minutes on 2 cores (38 for 459 cases).
# FAILURES_ARGS adds options, e.g. FAILURES_ARGS="--jobs 2". Sourced by bench.sh (PYTHON is set there).
# shellcheck disable=SC2086
$PYTHON bench/failure_battery.py ${FAILURES_ARGS:-} ||
  echo "bench.sh: the failure battery found bad cases: see bench/results/failures.md" >&2
