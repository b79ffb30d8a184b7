#!/usr/bin/env bash
# bench/gpu_check.sh: the one-command GPU check (bench/gpu_check.py says what it runs and how it judges).
#
#   bash bench/gpu_check.sh                  # every train script at 1 and at min(N, 8) GPUs, kernels, FP8
#   bash bench/gpu_check.sh --steps 30       # longer runs; --only tp,cp for a subset; --help for the rest
#   bash bench/gpu_check.sh --plan_sweep     # plan.py's predicted peak memory / OOM vs measured (bench/plan_sweep.py)
#
# Without a visible CUDA GPU it prints one line and exits 0, so CI can call it anywhere.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
n_gpus=$($PYTHON -c "import torch; print(torch.cuda.device_count())" 2>/dev/null)
if ! [[ "${n_gpus}" =~ ^[0-9]+$ ]] || [ "${n_gpus}" -lt 1 ]; then
  echo "gpu_check: skipped (no CUDA GPU visible)"
  exit 0
fi
exec $PYTHON bench/gpu_check.py "$@"
