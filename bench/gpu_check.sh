#!/usr/bin/env bash
# bench/gpu_check.sh: the one-command GPU check (bench/gpu_check.py says what it runs and how it judges).
#
#   bash bench/gpu_check.sh --budget_s 480 --out /tmp/gpu_check   # a lent GPU machine: rows in order of value
#   bash bench/gpu_check.sh --only cp,syncs                        # a subset; --help for the rest
#   bash bench/gpu_check.sh --plan_sweep                           # plan.py's peak memory / OOM vs measured
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh                # the interpreter (default: python or python3,
#                                                                  # the first that imports torch)
#
# Its command line is read first, anywhere: --help, and a flag it does not know is one error (exit 2). It cannot
# pass by accident. It skips (one line, exit 0, so CI can call it anywhere) only where no GPU exists: no nvidia-smi,
# or an nvidia-smi that lists no GPU; there --dry still lists the rows (it runs nothing). The driver's tool is
# asked, not torch, because a broken torch must not look like a machine without a GPU. Where a GPU exists, each
# missing piece is one "error:" line and exit 1: no python, no torch, a CPU-only torch build, a torch that cannot
# use the GPU (a driver older than its CUDA needs), no C compiler or no Python.h (Triton compiles a launcher with
# both), or a package the checks import that is neither importable nor installable. It installs nothing that is
# importable already (a GPU machine may have no network), and never torch or triton: a CUDA build of torch brings
# the triton it was built with, and requirements.txt's pins would replace them.
set -uo pipefail
here=${BASH_SOURCE[0]%/*}
[ "$here" = "${BASH_SOURCE[0]}" ] && here=.
cd "$here/.." || exit 1
if [ -z "${PYTHON:-}" ]; then       # the first of python, python3 that has torch (a GPU image's may be python3 alone)
  PYTHON=python3
  for candidate in python python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then
      PYTHON=$candidate
      break
    fi
  done
fi

fail() {
  echo "gpu_check: error: $*"
  exit 1
}

skip() {            # no GPU here: --dry still lists the rows (it needs torch, not a GPU); anything else skips
  for arg in "$@"; do
    [ "$arg" = --dry ] && exec "$PYTHON" bench/gpu_check.py "$@"
  done
  echo "gpu_check: skipped ($reason)"
  exit 0
}

# 0. The command line, before anything is looked for: --help and a bad flag need no GPU (no python: the probe says).
#    A PYTHON that runs but is not Python 3 (echo, true, a shell script) would otherwise "pass" every step below.
if command -v "$PYTHON" >/dev/null; then
  answer=$("$PYTHON" -c 'import sys; print("python", sys.version_info[0])' 2>&1)
  if [ "$answer" != "python 3" ]; then
    echo "gpu_check: error: PYTHON=$PYTHON is not a Python 3 interpreter (asked for its version, it answered: ${answer%%$'\n'*})"
    exit 2
  fi
  for arg in "$@"; do
    [[ $arg == -h || $arg == --help ]] && exec "$PYTHON" bench/gpu_check_args.py --help
  done
  "$PYTHON" bench/gpu_check_args.py "$@" || exit $?
fi

# 1. Is there a GPU? (bash builtins only from here to the python probe: nothing else is assumed on PATH). A wedged
#    driver can leave nvidia-smi waiting for ever: it gets NVIDIA_SMI_TIMEOUT seconds (default 30) per line.
if ! command -v nvidia-smi >/dev/null; then
  reason="no NVIDIA GPU here: nvidia-smi not found"
  skip "$@"
fi
smi_timeout=${NVIDIA_SMI_TIMEOUT:-30}
[[ $smi_timeout =~ ^[1-9][0-9]{0,4}$ ]] || fail "NVIDIA_SMI_TIMEOUT=$smi_timeout must be a whole number of seconds in 1..99999"
exec {smi_fd}< <(nvidia-smi -L 2>&1; echo "nvidia-smi exit $?")
smi_pid=$!
listing=""
smi_rc=""
while IFS= read -r -t "$smi_timeout" -u "$smi_fd" line; do
  if [[ $line =~ ^nvidia-smi\ exit\ ([0-9]+)$ ]]; then
    smi_rc=${BASH_REMATCH[1]}
    break
  fi
  listing+=$line$'\n'
done
exec {smi_fd}<&-
if [ -z "$smi_rc" ]; then
  kill "$smi_pid" 2>/dev/null
  fail "nvidia-smi -L gave no answer within $smi_timeout s (NVIDIA_SMI_TIMEOUT): a wedged driver? (nvidia-smi -L alone shows it)"
fi
n_gpus=0
while IFS= read -r line; do
  [[ $line == "GPU "* ]] && n_gpus=$((n_gpus + 1))
done <<< "$listing"
if [ "$n_gpus" -eq 0 ]; then
  if [ "$smi_rc" -eq 0 ] || [[ $listing == *"No devices were found"* ]]; then
    reason="nvidia-smi lists no GPU"
    skip "$@"
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

# 3. What Triton needs to compile its launchers: a C compiler and Python's headers
errors=0
if ! command -v "${CC:-cc}" >/dev/null && ! command -v gcc >/dev/null && ! command -v clang >/dev/null; then
  echo "gpu_check: error: no C compiler (cc, gcc or clang; or \$CC): Triton compiles a small launcher per kernel"
  errors=1
fi
headers=$("$PYTHON" -c 'import os, sysconfig; h = os.path.join(sysconfig.get_paths()["include"], "Python.h"); print(h if os.path.exists(h) else "missing " + h)' 2>&1)
if [[ $headers == "missing "* ]]; then
  echo "gpu_check: error: no ${headers#missing } (install this Python's development headers): Triton compiles its launchers against it"
  errors=1
fi
[ "$errors" -eq 0 ] || exit 1

# 4. The other packages the checks import (numpy, pytest): installed only where not importable, pinned as
#    requirements*.txt pin them; with no network that is one error line naming them
missing=()
for module in numpy pytest; do
  "$PYTHON" -c "import $module" 2>/dev/null || missing+=("$module")
done
if [ "${#missing[@]}" -gt 0 ]; then
  pins=()
  for file in requirements.txt requirements-test.txt; do
    while IFS= read -r line || [ -n "$line" ]; do
      for module in "${missing[@]}"; do
        [[ $line == "$module=="* || $line == "$module>"* || $line == "$module<"* ]] && pins+=("$line")
      done
    done < "$file"
  done
  echo "gpu_check: installing ${pins[*]} (not importable in $PYTHON)"
  "$PYTHON" -m pip install --quiet "${pins[@]}" >/dev/null 2>&1
  for module in "${missing[@]}"; do
    "$PYTHON" -c "import $module" 2>/dev/null ||
      fail "$module is not importable in $PYTHON, and installing ${pins[*]} did not help (no network?): install it"
  done
fi

echo "gpu_check: $probe"
exec "$PYTHON" bench/gpu_check.py "$@"
