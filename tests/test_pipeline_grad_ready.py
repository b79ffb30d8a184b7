"""train_5d's data-parallel reduction hidden behind the pipeline (compose/grad_ready.py): at pp 2 x dp 2 each
rank's record of its schedule's actions and its launches shows every gradient bucket launched right after the action
that completes it (the chunk's last B; under zb1 its last W, where dW comes), inside the schedule, not after it; only
ZeRO-1's tied bucket waits for the step's end, where its two copies are summed first. The launches stay NCCL-safe."""
import pytest

from distributed_helper import run_workers
from common.nccl_check import check
from train_helpers import tiny_argv

# (schedule, pp_virtual, layers, ZeRO stage): 1f1b, a split backward (with ZeRO-1's shards), two chunks per rank
RUNS = [("1f1b", 1, 2, 0), ("zb1", 1, 2, 1), ("interleaved", 2, 4, 0)]


def _recorded(rank, world, argvs):
    """train_5d.main for each argv with comm.py's launch log on and the runner's actions written into it as
    ("action", kind, mb, chunk), the schedule's end as ("end",): per run the log, the dp x cp group's ranks and each
    gradient bucket's bytes and chunks, in launch order."""
    import torch.distributed as dist
    import train_5d
    import train_pp
    from common import comm
    from pipeline.weight_grads import WeightGradStore
    runner, store = train_pp.PipelineRunner, WeightGradStore
    forward, backward, compute, step = runner._forward, runner._backward, store.compute, runner.step

    def mark(kind, mb, chunk):
        comm.LAUNCH_LOG.append(("action", kind, mb, chunk))

    def marked_step(self, *args):
        out = step(self, *args)
        comm.LAUNCH_LOG.append(("end",))
        return out
    runner._forward = lambda self, a, *rest: mark(*a) or forward(self, a, *rest)
    runner._backward = lambda self, a, *rest: mark(*a) or backward(self, a, *rest)
    store.compute = lambda self, key: mark("W", *key) or compute(self, key)
    runner.step = marked_step
    out = []
    for argv in argvs:
        comm.LAUNCH_LOG = []
        result = train_5d.main(argv)
        chunks = list(result["chunks"])
        buckets = [(b.buffer.numel() * b.buffer.element_size(),
                    sorted({i for i, c in enumerate(chunks) for p in b.params if any(p is q for q in c.parameters())}))
                   for grads in result["dp_axis"].reductions() for b in grads.buckets]
        out.append(dict(log=comm.LAUNCH_LOG, buckets=buckets,
                        dp=tuple(dist.get_process_group_ranks(result["grid"].groups.dp_cp))))
        comm.LAUNCH_LOG = None
    return out


def launch_order(run, zero_stage):
    """[(bucket, the action it was launched right after, where in the log)] of one rank's step, asserting that each
    bucket launches after the last action writing its chunks' gradients, with no other action or the end between."""
    log = run["log"]
    end = log.index(("end",))
    last = {}                                    # chunk -> where its last B or W is in the log
    for i, e in enumerate(log[:end]):
        if e[0] == "action" and e[1] != "F":
            last[e[3]] = i
    start = next(i for i, e in enumerate(log) if e[0] == "action")   # (before it: start-up checks, the replicas')
    dp = [i for i, e in enumerate(log) if i > start and isinstance(e, list) and e[0][0] == "coll"
          and e[0][3] == run["dp"]]
    held = int(zero_stage == 1)                  # pp 2: every rank holds a copy of the tied weight
    early = [i for i in dp if i < end]
    assert len(early) == len(run["buckets"]) - held, "buckets launched after the schedule"
    order = []
    for k, (i, (nbytes, chunks)) in enumerate(zip(early, run["buckets"])):
        done = max(last[c] for c in chunks)
        assert log[i][0][2] == nbytes and done < i, (k, log[i], log[done])
        assert not any(e[0] in ("action", "end") for e in log[done + 1: i]), f"bucket {k} waited past {log[done]}"
        order.append((k, log[done][1:], i))
    if held:                                     # the tied bucket: after the schedule, before anything else on dp
        assert dp[len(early)] > end and log[dp[len(early)]][0][2] == run["buckets"][-1][0]
    return order


def test_buckets_launch_after_the_backward_that_completes_them(tiny_data, tmp_path):
    argvs = [tiny_argv(tiny_data, str(tmp_path / f"run{i}"), dp=2, pp=2, pp_schedule=name, pp_virtual=v,
                       n_layer=layers, zero_stage=zero, micro_batch_size=2, max_steps=1, bucket_mb=0.01)
             for i, (name, v, layers, zero) in enumerate(RUNS)]
    logs = run_workers(_recorded, 4, args=(argvs,), timeout=600)
    for i, (name, v, layers, zero) in enumerate(RUNS):
        runs = [logs[r][i] for r in range(4)]
        assert check([[e for e in run["log"] if isinstance(e, list)] for run in runs]) == [], name
        for rank, run in enumerate(runs):
            order = launch_order(run, zero)
            assert len(order) >= 3, (name, rank, order)           # several buckets, each placed
            if rank >= 2 and name != "zb1":   # the last stage: before its last send, which the first stage awaits
                log = run["log"]
                assert any(e[0][0] == "send" for e in log[order[-1][2]: log.index(("end",))] if isinstance(e, list))


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("zb1", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2)])
def test_last_grad_writers(name, v):
    """Each chunk's gradients are final after its last B, or its last W under a split backward."""
    from compose.grad_ready import last_grad_writers
    from pipeline.schedules import SPLIT_BACKWARD
    from train_pp import make_schedule
    for actions in make_schedule(name, 2, 4, v):
        last = last_grad_writers(actions)
        kind = "W" if name in SPLIT_BACKWARD else "B"
        assert sorted(last) == list(range(v))
        for chunk, a in last.items():
            assert a.kind == kind and a.chunk == chunk
            assert not any(b.chunk == chunk and b.kind != "F" for b in actions[actions.index(a) + 1:])
