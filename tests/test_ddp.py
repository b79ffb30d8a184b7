"""train_ddp.py: parity with train_single.py in every mode, exact communication bytes, bucket layout, bad input."""
import os

import pytest
import torch

from distributed_helper import run_workers
from train_helpers import (EXACT, MODELS, assert_exact, assert_same_losses, assert_same_weights, curves, losses,
                           run_single, text_argv, tiny_argv)

GBS = 12          # divisible by micro x dp for dp 2 and 4 with grad_acc 1 and 3


def _ddp_runs(rank, world_size, runs):
    """Run several train_ddp.main configurations in one process group; rank 0 returns their results."""
    import train_ddp
    out = []
    for argv in runs:
        result = train_ddp.main(argv)
        grads = result["grads"]
        out.append(dict(
            losses=losses(argv[argv.index("--out_dir") + 1]) if rank == 0 else None,
            state=_numpy_state(result["model"]),
            rows=_rows(argv) if rank == 0 else None,
            buckets=[[id(p) for p in b.params] for b in grads.buckets],
            bucket_numels=[b.numel for b in grads.buckets],
            param_ids=[id(p) for p in result["model"].parameters()],
            param_numels=[p.numel() for p in result["model"].parameters()]))
    return out


def _numpy_state(model):
    # numpy arrays pickle by value; torch tensors would travel as shared memory of an exiting process
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _torch_state(state):
    return {n: torch.from_numpy(a) for n, a in state.items()}


def _rows(argv):
    from common.metrics import read_metrics
    return read_metrics(argv[argv.index("--out_dir") + 1])


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("single"))
    return run_single(tiny_argv(tiny_data, out, global_batch_size=GBS, micro_batch_size=GBS))


def _grad_bytes():
    """Gradient bytes of tiny_argv's model from model.py's parameter-count formula (fp32)."""
    from model import GPTConfig, num_params
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    return num_params(cfg) * 4        # fp32 gradients


@pytest.mark.parametrize("dp", [2, 4])
def test_parity_and_comm_bytes(dp, reference, tiny_data, tmp_path):
    """Each mode, with grad_acc 1 and 3, reproduces train_single; comm is one all-reduce volume per step."""
    ref_losses, ref_state = reference
    runs, labels = [], []
    for mode in ("naive", "overlap", "bucket"):
        for grad_acc in (1, 3):
            mbs = GBS // (dp * grad_acc)
            out = str(tmp_path / f"{mode}_{grad_acc}")
            runs.append(tiny_argv(tiny_data, out, global_batch_size=GBS, micro_batch_size=mbs, ddp_mode=mode,
                                  bucket_mb=0.004))          # ~1000 floats: several buckets in the tiny model
            labels.append((mode, grad_acc))
    results = run_workers(_ddp_runs, dp, args=(runs,), timeout=600)
    P_bytes = _grad_bytes()
    for (mode, grad_acc), r0, r_last in zip(labels, results[0], results[-1]):
        assert_same_losses(ref_losses, r0["losses"])
        assert_same_weights(ref_state, _torch_state(r0["state"]))
        # replicas stay bit-identical
        assert_same_weights(_torch_state(r0["state"]), _torch_state(r_last["state"]), rtol=0.0)
        n_tensors = len(r0["param_ids"])
        expected_calls = len(r0["buckets"]) if mode == "bucket" else n_tensors
        for row in r0["rows"]:
            # the convention of docs/observability.md: all_reduce = 2(n-1)/n * S, once per optimizer step whatever grad_acc is
            assert row["comm_bytes"] == 2 * (dp - 1) / dp * P_bytes, (mode, grad_acc, row)
            assert row["comm_calls"] == expected_calls, (mode, grad_acc, row)
        if mode == "bucket":
            assert len(r0["buckets"]) > 2


def test_float64_parity_exact(text_reference_for, text_data, tmp_path):
    """float64 on real text across a gradient spike, clipping on: every mode with grad_acc 1 and 2 (and buckets on
    the family's GQA + untied model) reproduces train_single within 1e-9 per step (loss and grad norm) and in the
    final weights."""
    runs, refs = [], []
    for mode, grad_acc, model in [(m, g, "L2") for m in ("naive", "overlap", "bucket") for g in (1, 2)] + [
            ("bucket", 1, "GQA")]:
        runs.append(text_argv(text_data, str(tmp_path / f"{mode}_{grad_acc}_{model}"), micro_batch_size=4 // grad_acc,
                              ddp_mode=mode, bucket_mb=0.008, **MODELS[model]))
        refs.append(text_reference_for(model))
    results = run_workers(_ddp_runs, 2, args=(runs,), timeout=600)
    for argv, r0, (ref_curves, ref_state) in zip(runs, results[0], refs):
        assert_exact(ref_curves, curves(argv[argv.index("--out_dir") + 1]))
        assert_same_weights(ref_state, _torch_state(r0["state"]), rtol=EXACT)
        assert all(a.dtype.name == "float64" for a in r0["state"].values())


def _check_buckets(r, cap_bytes):
    ids, numels = r["param_ids"], dict(zip(r["param_ids"], r["param_numels"]))
    flat = [pid for b in r["buckets"] for pid in b]
    assert flat == list(reversed(ids)), "buckets must hold every parameter once, in reverse order of use"
    for b, nxt in zip(r["buckets"], r["buckets"][1:] + [None]):
        size = sum(numels[p] for p in b) * 4
        assert size <= cap_bytes or len(b) == 1, "a bucket over the cap must be a single large parameter"
        if nxt is not None:      # greedy: the next parameter did not fit
            assert size + numels[nxt[0]] * 4 > cap_bytes
    return len(r["buckets"])


def test_bucket_count(tiny_data, tmp_path):
    from train_ddp import assign_buckets
    sizes = [10, 20, 30, 5, 100, 1]
    params = [torch.zeros(s) for s in sizes]
    groups = assign_buckets(params, bucket_bytes=40 * 4)
    assert [[p.numel() for p in g] for g in groups] == [[10, 20], [30, 5], [100], [1]]

    caps = {"tiny": 1e-6, "mid": 0.004, "huge": 25.0}
    runs = [tiny_argv(tiny_data, str(tmp_path / k), max_steps=2, ddp_mode="bucket", bucket_mb=mb)
            for k, mb in caps.items()]
    results = run_workers(_ddp_runs, 2, args=(runs,), timeout=300)[0]
    n_params = len(results[0]["param_ids"])
    counts = {k: _check_buckets(r, mb * 2 ** 20) for (k, mb), r in zip(caps.items(), results)}
    assert counts["tiny"] == n_params            # every parameter alone
    assert counts["huge"] == 1                   # the whole model in one 25 MiB bucket
    assert 1 < counts["mid"] < n_params
    for r in results:
        for row in r["rows"]:
            assert row["comm_calls"] == len(r["buckets"])


def _mismatch(rank, world_size, argv):
    import train_ddp
    from common.distributed import init_distributed
    from common.config import parse_config
    import torch.distributed as dist
    # the building block on its own: one rank's weights perturbed in the last bit
    init_distributed(parse_config(["--device", "cpu"]))
    params = [torch.ones(3), torch.ones(5)]
    train_ddp.check_replicas_agree(params, dist.group.WORLD)           # identical: passes
    if rank == 1:
        params[1][4] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    try:
        train_ddp.check_replicas_agree(params, dist.group.WORLD)
        caught = None
    except train_ddp.ReplicaMismatch as e:
        caught = str(e)
    # the script: a different seed per rank must stop with exit code 2 before training
    argv = list(argv)
    argv[argv.index("--seed") + 1] = str(1234 + rank)
    try:
        train_ddp.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    return caught, code


def test_mismatched_replicas_fail_clearly(tiny_data, tmp_path):
    results = run_workers(_mismatch, 2, args=(tiny_argv(tiny_data, str(tmp_path)),), timeout=120)
    for caught, code in results:
        assert caught is not None and "replicas differ" in caught
        assert code == 2
    assert not os.path.exists(tmp_path / "metrics.jsonl"), "no training step may run"


def test_indivisible_batch_is_one_clear_error(tiny_data, tmp_path, monkeypatch, capsys):
    import train_ddp
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit) as e:
        train_ddp.main(tiny_argv(tiny_data, str(tmp_path), global_batch_size=8, micro_batch_size=4))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "divisible" in err[0]


def test_world_size_one_warns_and_matches_single(tiny_data, tmp_path, capsys):
    import torch.distributed as dist
    import train_ddp
    argv = dict(max_steps=4, global_batch_size=8, micro_batch_size=4)
    ref_losses, ref_state = run_single(tiny_argv(tiny_data, str(tmp_path / "single"), **argv))
    try:
        result = train_ddp.main(tiny_argv(tiny_data, str(tmp_path / "ddp"), **argv))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert "warning: world size 1" in capsys.readouterr().err
    assert_same_losses(ref_losses, losses(str(tmp_path / "ddp")))
    # not bit-identical (the clipping norm is summed over flat buckets, not tensor by tensor): the parity contract's 1e-4
    assert_same_weights(ref_state, {n: p.detach() for n, p in result["model"].named_parameters()})


def _slow_rank0_worker(rank, world, delay):
    """Rank 0 'saves' for `delay` seconds while the others wait at wait_for_main_rank (--dist_timeout 2)."""
    import contextlib
    import io
    import time
    import torch.distributed as dist
    from common.distributed import init_distributed
    from common.config import Config
    from common.distributed import wait_for_main_rank
    init_distributed(Config(device="cpu", dist_timeout=2.0))
    err, code = io.StringIO(), 0
    if rank == 0:
        time.sleep(delay)
    with contextlib.redirect_stderr(err):
        try:
            wait_for_main_rank(dist.group.WORLD, Config(dist_timeout=2.0), "checkpoint save")
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def test_ranks_wait_for_rank0_save_within_dist_timeout():
    """After a rank-0-only save or evaluation the others wait at a barrier bounded by --dist_timeout: a quick
    save passes, a save longer than the timeout is reported by the waiting rank as what it is."""
    assert run_workers(_slow_rank0_worker, 2, args=(0.5,), timeout=60) == [(0, ""), (0, "")]
    code, err = run_workers(_slow_rank0_worker, 2, args=(6.0,), timeout=60)[1]
    assert code == 2 and err.startswith("error: rank 1: waited longer than --dist_timeout 2 s for rank 0's "
                                        "checkpoint save"), err
