#!/usr/bin/env bash
# bench/gpu_check.sh: the one-command GPU check (bench/gpu_check.py says what it runs and how it judges).
#
#   bash bench/gpu_check.sh                  # every train script at 1 and at min(N, 8) GPUs, kernels, FP8
#   bash bench/gpu_check.sh --steps 30       # longer runs; --only tp,cp for a subset; --help for the rest
#   bash bench/gpu_check.sh --plan_sweep     # plan.py's predicted peak memory / OOM vs measured (bench/plan_sweep.py)
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh      # the interpreter to check with (default: python)
#
# It cannot pass by accident. It skips (one line, exit 0, so CI can call it anywhere) only where no GPU exists:
# no nvidia-smi, or an nvidia-smi that lists no GPU. The driver's tool is asked, not torch, because a broken
# torch must not look like a machine without a GPU. Where a GPU exists, each missing piece is one "error:" line
# and exit 1: no python at $PYTHON, no torch, a CPU-only torch build, a torch that cannot use the GPU (a driver
# older than its CUDA needs), or the test requirements failing to install. It installs those (pytest and the
# other pins) but never torch or triton: pip could replace the machine's CUDA build of torch with another
# build, and a CUDA build of torch brings the triton it was built with.
set -uo pipefail
here=${BASH_SOURCE[0]%/*}
[ "$here" = "${BASH_SOURCE[0]}" ] && here=.
cd "$here/.." || exit 1
PYTHON=${PYTHON:-python}

fail() {
  echo "gpu_check: error: $*"
  exit 1
}

# 1. Is there a GPU? (bash builtins only from here to the python probe: nothing else is assumed on PATH)
if ! command -v nvidia-smi >/dev/null; then
  echo "gpu_check: skipped (no NVIDIA GPU here: nvidia-smi not found)"
  exit 0
fi
listing=$(nvidia-smi -L 2>&1)
smi_rc=$?
n_gpus=0
while IFS= read -r line; do
  [[ $line == "GPU "* ]] && n_gpus=$((n_gpus + 1))
done <<< "$listing"
if [ "$n_gpus" -eq 0 ]; then
  if [ "$smi_rc" -eq 0 ] || [[ $listing == *"No devices were found"* ]]; then
    echo "gpu_check: skipped (nvidia-smi lists no GPU)"
    exit 0
  fi
  fail "nvidia-smi failed (exit $smi_rc): ${listing%%$'\n'*}"
fi

# 2. A GPU exists: the interpreter, a CUDA build of torch, and torch seeing the GPU
command -v "$PYTHON" >/dev/null || fail "no python at PYTHON=$PYTHON (nvidia-smi lists $n_gpus GPU(s))"
probe=$("$PYTHON" - 2>&1 <<'PROBE'
import sys
import warnings
try:
    import torch
except ImportError as e:
    sys.exit(f"no torch in {sys.executable} ({e}): install a CUDA build of torch first")
if torch.version.cuda is None:
    sys.exit(f"torch {torch.__version__} in {sys.executable} is a CPU-only build: install a CUDA build of torch")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    usable = torch.cuda.is_available() and torch.cuda.device_count() > 0
if not usable:
    why = str(caught[0].message).splitlines()[0] if caught else "no driver message"
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) cannot use the GPU: torch.cuda.is_available() "
             f"is False ({why}); is the driver older than CUDA {torch.version.cuda} needs, or CUDA_VISIBLE_DEVICES empty?")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")
PROBE
) || fail "${probe##*$'\n'}"

# 3. What the checks need besides torch: every pin of requirements*.txt except torch and triton
pins=()
for file in requirements.txt requirements-test.txt; do
  while IFS= read -r line || [ -n "$line" ]; do
    case $line in
      "" | "#"* | torch* | triton*) ;;
      *) pins+=("$line") ;;
    esac
  done < "$file"
done
"$PYTHON" -m pip install --quiet "${pins[@]}" || fail "could not install ${pins[*]} into $PYTHON"

echo "gpu_check: $probe"
exec "$PYTHON" bench/gpu_check.py "$@"
