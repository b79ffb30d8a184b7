#!/usr/bin/env bash
#SBATCH --job-name=nanoscale
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
# Any training script on N nodes under SLURM: one torchrun agent per node, every agent joining one c10d rendezvous
# hosted on the job's first node. Each agent starts one rank per GPU of its node; a rank takes cuda:LOCAL_RANK of
# the GPUs SLURM shows the node. Every node holds G consecutive ranks, so tp (innermost on the grid) stays inside a
# node whenever tp divides G.
#
#   sbatch --nodes 4 --gpus-per-node 8 bench/slurm.sh train_5d.py --tp 8 --pp 2 --resume auto --out_dir out/run
#   bash bench/slurm.sh --dry train_ddp.py ...     # inside an allocation (salloc): print each node's launch line
#
# --ntasks-per-node must stay 1 (one agent per node; the agent starts the node's ranks). Elastic restarts:
# MAX_RESTARTS (default 0) is passed to torchrun as --max-restarts, so a rank or node that dies restarts every rank
# from the last checkpoint when the script runs with --resume auto (docs/failures.md). Other settings by variable:
# PYTHON (default python3), MASTER_PORT (the rendezvous port, default 29500), GPUS_PER_NODE (default: the GPUs
# SLURM gives the node, SLURM_GPUS_ON_NODE, else the entries of CUDA_VISIBLE_DEVICES, else 1 for a CPU run).
set -euo pipefail

dry=0
if [[ "${1:-}" == "--dry" ]]; then dry=1; shift; fi
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '/^#SBATCH/d; /^set -euo/q; 2,$s/^# \{0,1\}//p' "$0"
    [[ $# -ge 1 ]] && exit 0 || exit 2
fi
fail() { echo "error: $*" >&2; exit 2; }

[[ -n "${SLURM_JOB_ID:-}" && -n "${SLURM_JOB_NODELIST:-}" ]] ||
    fail "no SLURM allocation here (SLURM_JOB_ID / SLURM_JOB_NODELIST unset): submit with sbatch, or run inside salloc"
[[ "${SLURM_NTASKS_PER_NODE:-1}" == "1" ]] ||
    fail "--ntasks-per-node=${SLURM_NTASKS_PER_NODE}: this script starts one torchrun per node, which starts the node's ranks; use --ntasks-per-node=1"
[[ -f "$1" ]] || fail "$1: no such training script (run from the repository root)"

nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
# (not `| head -n 1`: under pipefail, scontrol killed by SIGPIPE after the first host would end the script with 141)
hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST") || fail "scontrol show hostnames $SLURM_JOB_NODELIST failed"
head=${hosts%%$'\n'*}
[[ -n "$head" ]] || fail "scontrol found no host in SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
if [[ -n "${GPUS_PER_NODE:-}" ]]; then
    gpus=$GPUS_PER_NODE
elif [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
    gpus=$SLURM_GPUS_ON_NODE
elif [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    IFS=, read -r -a visible <<< "$CUDA_VISIBLE_DEVICES"
    gpus=${#visible[@]}
else
    gpus=1
fi
[[ "$gpus" =~ ^[1-9][0-9]*$ ]] || fail "GPUS_PER_NODE=$gpus: ranks per node must be a positive integer"
port=${MASTER_PORT:-29500}
[[ "$port" =~ ^[1-9][0-9]*$ && "$port" -le 65535 ]] || fail "MASTER_PORT=$port is not a port number"

# A node started again in place of a dead one (MAX_RESTARTS) would wait forever in the new rendezvous round while
# torchrun's agents share their rendezvous store with the ranks (pytorch/pytorch#135712): keep them apart.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# c10d numbers the agents when they meet (torchrun ignores --node_rank with it), but each agent's ranks are
# contiguous: every node holds G consecutive ranks, whichever node comes first.
launch=("${PYTHON:-python3}" -m torch.distributed.run --nnodes "$nodes" --nproc_per_node "$gpus"
        --rdzv_backend c10d --rdzv_endpoint "$head:$port" --rdzv_id "nanoscale-$SLURM_JOB_ID"
        --max-restarts "${MAX_RESTARTS:-0}" "$@")
if [[ $dry == 1 ]]; then
    per_node='echo "node $SLURM_NODEID: $*"'                   # single quotes: evaluated on each node
else
    per_node='echo "node $SLURM_NODEID ($(hostname)): $*" >&2; exec "$@"'
fi
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "$per_node" _ "${launch[@]}"
