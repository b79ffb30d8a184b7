"""Several nodes on one machine: torchrun agents that meet in one c10d rendezvous (--nnodes 2), as two nodes of a
cluster would, train equal to train_single in float64; a node killed mid-run and started again under
--max-restarts resumes from the last checkpoint; bench/slurm.sh's launch lines, rank mapping and GPU choice under
a fake srun (each "node" is a process group here, every rank on the CPU with gloo)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from common.metrics import read_metrics
from train_helpers import assert_exact, curves, text_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM = os.path.join(ROOT, "bench", "slurm.sh")

# srun as SLURM runs it on every node of the allocation: the command once per node, each with its SLURM_NODEID.
FAKE_SRUN = """#!/usr/bin/env bash
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
    SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" & pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] || exit 1
for h in $FAKE_HOSTS; do echo "$h"; done
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_env(tmp_path, nodes=2, hosts="127.0.0.1 127.0.0.1", **extra):
    """The environment sbatch gives a job of `nodes` nodes, with srun and scontrol faked on PATH."""
    bin_dir = tmp_path / "fake_bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "CUDA_VISIBLE"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", PYTHON=sys.executable, OMP_NUM_THREADS="1", FAKE_HOSTS=hosts,
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=f"node[1-{nodes}]", SLURM_JOB_NUM_NODES=str(nodes),
               MASTER_PORT=str(free_port()), **extra)
    return env


def run(cmd, env, timeout=300):
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        out = job.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out = job.communicate()[0] + "\n<timed out>"
    return job.returncode, out


def test_slurm_script_launches_one_agent_per_node_with_the_nodes_gpus(tmp_path):
    env = slurm_env(tmp_path, hosts="gpu-a07 gpu-a08", CUDA_VISIBLE_DEVICES="0,1,2,3")
    rc, out = run(["bash", SLURM, "--dry", "train_ddp.py", "--max_steps", "3"], env)
    assert rc == 0, out
    port = env["MASTER_PORT"]
    for node in (0, 1):
        assert (f"node {node}: {sys.executable} -m torch.distributed.run --nnodes 2 --nproc_per_node 4 --rdzv_backend "
                f"c10d --rdzv_endpoint gpu-a07:{port} --rdzv_id nanoscale-4242 --max-restarts 0 train_ddp.py "
                f"--max_steps 3") in out, out
    rc, out = run(["bash", SLURM, "--dry", "train_5d.py"], dict(env, SLURM_GPUS_ON_NODE="8", MAX_RESTARTS="3"))
    assert rc == 0 and out.count("--nproc_per_node 8") == 2 and out.count("--max-restarts 3") == 2, out


@pytest.mark.parametrize("change, message", [
    (dict(SLURM_NTASKS_PER_NODE="8"), "use --ntasks-per-node=1"),
    (dict(SLURM_JOB_ID=""), "no SLURM allocation here"),
    (dict(GPUS_PER_NODE="0"), "GPUS_PER_NODE=0: ranks per node must be a positive integer"),
    (dict(MASTER_PORT="70000"), "MASTER_PORT=70000 is not a port number"),
])
def test_slurm_script_refuses_a_wrong_allocation_in_one_line(tmp_path, change, message):
    rc, out = run(["bash", SLURM, "train_ddp.py"], {**slurm_env(tmp_path), **change})
    assert rc == 2 and out.strip().splitlines() == [f"error: {out.strip().split('error: ', 1)[1]}"], out
    assert message in out, out


PROBE = """
import json, os, sys
sys.path.insert(0, {root!r})
import torch
from common.distributed import pick_device
torch.cuda.is_available = lambda: True                     # the GPUs the fake allocation shows this node
torch.cuda.device_count = lambda: len(os.environ["CUDA_VISIBLE_DEVICES"].split(","))
torch.cuda.set_device = lambda device: None
keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "SLURM_NODEID", "CUDA_VISIBLE_DEVICES")
row = {{k: os.environ[k] for k in keys}}
row["device"] = str(pick_device("auto", int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])))
with open(os.path.join({out!r}, os.environ["RANK"] + ".json"), "w") as f:
    json.dump(row, f)
"""


def test_slurm_ranks_fill_each_node_and_take_its_gpus_in_order(tmp_path):
    """Two nodes of two GPUs each: four ranks, two consecutive ones per node, each on cuda:LOCAL_RANK of the GPUs
    its node shows (as SLURM's --gpus-per-node sets CUDA_VISIBLE_DEVICES)."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE.format(root=ROOT, out=str(tmp_path)))
    rc, out = run(["bash", SLURM, str(probe)], slurm_env(tmp_path, CUDA_VISIBLE_DEVICES="4,5"), timeout=120)
    assert rc == 0, out
    rows = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert all(row["WORLD_SIZE"] == "4" and row["CUDA_VISIBLE_DEVICES"] == "4,5" for row in rows), rows
    for r, row in enumerate(rows):
        assert int(row["GROUP_RANK"]) * 2 + int(row["LOCAL_RANK"]) == r, rows       # node g holds ranks 2g, 2g+1
        assert row["device"] == f"cuda:{r % 2}", rows
    nodes_of = {row["SLURM_NODEID"] for row in rows[:2]}, {row["SLURM_NODEID"] for row in rows[2:]}
    assert len(nodes_of[0]) == len(nodes_of[1]) == 1 and nodes_of[0] != nodes_of[1], rows


def test_train_5d_on_two_nodes_under_slurm_equals_single(text_reference, text_data, tmp_path):
    """train_5d at dp 2 x tp 2 (SP on), two nodes of two ranks each launched by bench/slurm.sh: float64 parity."""
    out = str(tmp_path / "run")
    argv = text_argv(text_data, out, micro_batch_size=4, tp=2, sp=True, dist_timeout=120)
    rc, output = run(["bash", SLURM, "train_5d.py", *argv], slurm_env(tmp_path, GPUS_PER_NODE="2"), timeout=400)
    assert rc == 0, output[-6000:]
    assert_exact(text_reference[0], curves(out))


KILLS_ITS_NODE = """
import os, signal, sys
sys.path.insert(0, {root!r})
import train_ddp
from common import distributed, optim

real_lr_at = optim.lr_at


def lr_at(step, cfg):   # node b dies at step {step}, once: its agent and this rank, as when a machine goes down
    if step == {step} and os.environ["NODE"] == "b" and not os.path.exists({marker!r}):
        open({marker!r}, "w").close()
        os.kill(os.getppid(), signal.SIGKILL)
        os._exit(13)
    return real_lr_at(step, cfg)


optim.lr_at = lr_at     # train_ddp.main imports its plumbing when it runs: it gets this one
train_ddp.main(sys.argv[1:])
distributed.destroy()
"""


def test_a_killed_node_started_again_resumes_with_the_same_losses(text_reference, text_data, tmp_path):
    """train_ddp on two nodes (two torchrun agents, one c10d rendezvous, --max-restarts 2, --resume auto): node b,
    agent and rank, dies at step 7, after the checkpoint of step 5. The surviving agent restarts its rank; node b is
    started again with the same command, as a cluster's scheduler would; the two meet in a new rendezvous round,
    resume from step 6 and finish with train_single's losses. Steps 6 appear twice in metrics.jsonl; the later
    row is the truth."""
    out = str(tmp_path / "run")
    script = tmp_path / "kills_its_node.py"
    script.write_text(KILLS_ITS_NODE.format(root=ROOT, step=7, marker=str(tmp_path / "killed")))
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes",
           "--rdzv_conf", "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1,read_timeout=300",
           "--max-restarts", "2", "--monitor-interval", "0.2", str(script)]
    # read_timeout: how long an agent's store read waits (torch's default 60 s). The restarted agent reads the new
    # round's MASTER_ADDR while its peer is still stopping its rank; on a loaded 2-core machine that took over 60 s.
    cmd += text_argv(text_data, out, resume="auto", dist_timeout=60, micro_batch_size=4, save_interval=3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"     # as bench/slurm.sh sets it: a node that replaces one hangs
                                                        # the new round otherwise (pytorch/pytorch#135712)

    def start(node):
        return subprocess.Popen(cmd, cwd=ROOT, env=dict(env, OMP_NUM_THREADS="1", NODE=node), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    node_a = start("a")
    deadline = time.time() + 60
    while time.time() < deadline:               # node a hosts the rendezvous: it listens before node b starts
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    nodes = [node_a, start("b")]
    try:
        nodes[1].wait(timeout=300)              # node b goes down at step 7
        first_b = nodes[1].stdout.read()
        assert os.path.exists(tmp_path / "killed"), first_b[-4000:]
        time.sleep(3)                           # node b comes back once the rendezvous knows it left
        nodes.append(start("b"))
        outputs = [p.communicate(timeout=300)[0] for p in (nodes[0], nodes[2])]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert nodes[0].returncode == 0 and nodes[2].returncode == 0, "\n".join(o[-4000:] for o in outputs)
    assert "steps 6..21" in "".join(outputs), outputs[0][-4000:]          # the restart resumed from step 6
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [row["step"] for row in map(json.loads, f) if "loss" in row]
    assert steps == list(range(7)) + list(range(6, 22)), steps            # step 6 ran before the crash and again
    assert_exact(text_reference[0], curves(out))
    assert [r["step"] for r in read_metrics(out)] == list(range(22))       # read back, the later row of a step wins
