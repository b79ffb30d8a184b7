"""ZeRO-R's Pa (converters/partition_activations.py): train_tp and train_5d with --partition_activations (and
--offload_activations) equal train_single in float64 at 1e-9; one block keeps exactly 1/t of what the unpartitioned
recompute keeps and sends one all-gather of its input, 1/12 of TP's own traffic; the steps' counted bytes grow by
exactly that; bad combinations are one error line. One spawn of 2 ranks runs every configuration."""
import pytest
import torch

from distributed_helper import run_workers
from common.metrics import read_metrics
from common.tp_shards import gather_full_weights
from train_helpers import EXACT, assert_exact, assert_same_weights, curves, text_argv

RUNS = dict(pa=("train_tp", dict(partition_activations=True)),
            pa_offload=("train_tp", dict(partition_activations=True, offload_activations=True)),
            plain=("train_tp", dict()),
            pa_5d=("train_5d", dict(partition_activations=True)),
            plain_dropout=("train_tp", dict(dropout=0.1, max_steps=4)),
            pa_dropout=("train_tp", dict(dropout=0.1, max_steps=4, partition_activations=True)))


def _block_report(t):
    """One TP block's saved bytes under the unpartitioned recompute (a reentrant checkpoint keeps its whole input as
    a saved tensor) and under Pa, and the collectives of Pa's backward by kind."""
    import torch.distributed as dist
    import model as M
    import train_tp
    from torch.utils.checkpoint import checkpoint
    from common.comm import COMM
    from common.metrics import SavedActivationBytes
    from converters.partition_activations import partition_activations
    g, b, s, h = dist.group.WORLD, 2, 32, 64
    cfg = M.GPTConfig(vocab_size=64, block_size=s, n_layer=1, n_head=8, n_embd=h)
    rope = M.rope_cache(h // 8, torch.arange(s))
    report = {}
    for mode in ("recompute", "pa"):
        with torch.device("meta"):
            gpt = M.GPT(cfg)
        train_tp.apply_tp(gpt, g)
        from common.tp_shards import init_tp_weights
        init_tp_weights(gpt, 0, g)
        block = gpt.transformer.h[0]
        if mode == "pa":
            partition_activations([block], g)
            run = block
        else:
            def run(x, rope):
                return checkpoint(block, x, rope, use_reentrant=True)
        x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(1)).requires_grad_()
        activations = SavedActivationBytes(block)
        activations.skip.add(rope.untyped_storage().data_ptr())
        with activations:
            y = run(x, rope)
        COMM.reset()
        y.square().sum().backward()
        report[mode] = dict(saved=activations.bytes, calls=dict(COMM.calls), by_op=dict(COMM.by_op),
                            grad=x.grad.numpy().copy())
    return report


def _worker(rank, n, argvs):
    import importlib
    out = {}
    for name, (script, argv) in argvs.items():
        result = importlib.import_module(script).main(argv)
        if script == "train_tp":
            full = gather_full_weights(result["model"], result["group"])
            out[name] = {k: v.numpy().copy() for k, v in full.items()} if rank == 0 else None
    out["block"] = _block_report(n)
    return out


@pytest.fixture(scope="module")
def runs(text_data, tmp_path_factory):
    dirs = {name: str(tmp_path_factory.mktemp(f"pa_{name}")) for name in RUNS}
    argvs = {name: (script, text_argv(text_data, dirs[name], tp=2, micro_batch_size=4, recompute="full", **flags))
             for name, (script, flags) in RUNS.items()}
    return dirs, run_workers(_worker, 2, args=(argvs,), timeout=900)[0]


@pytest.mark.parametrize("name", ["pa", "pa_offload", "pa_5d"])
def test_float64_parity_with_single(runs, text_reference, name):
    dirs, results = runs
    assert_exact(text_reference[0], curves(dirs[name]))
    if name in results:
        assert_same_weights(text_reference[1], {k: torch.from_numpy(a) for k, a in results[name].items()},
                            rtol=EXACT)


def test_dropout_masks_replayed_in_the_recompute(runs):
    """The recompute draws the forward's dropout masks again (shared and per-TP-rank streams): Pa's run is the plain
    recompute's, bit for bit."""
    dirs, _ = runs
    assert curves(dirs["pa_dropout"]) == curves(dirs["plain_dropout"])


def test_one_block_keeps_one_tp_th_and_gathers_once(runs):
    _, results = runs
    rep, t, S = results["block"], 2, 2 * 32 * 64 * 4            # S: the block input's bytes (fp32)
    assert rep["recompute"]["saved"] == S                         # model.activation_bytes_per_layer(recompute=full)
    assert rep["pa"]["saved"] * t == rep["recompute"]["saved"]   # Pa: exactly 1/t of it
    assert (rep["pa"]["grad"] == rep["recompute"]["grad"]).all()
    gathered = rep["pa"]["by_op"]["all_gather"]
    assert rep["pa"]["calls"]["all_gather"] == 1 and gathered == (t - 1) / t * S
    # ZeRO's analysis: TP with recompute sends 6 all-reduces of 2(t-1)/t * S per block (2 forward, 2 recomputed, 2
    # backward); Pa adds 1/12 of that ("under 10%"). torch's checkpoint recomputes only up to the last tensor backward
    # needs: 1 all-reduce of the 2, so backward counts 3
    assert rep["pa"]["calls"]["all_reduce"] == 3 and rep["pa"]["by_op"]["all_reduce"] == 3 * 2 * (t - 1) / t * S
    assert gathered / (6 * 2 * (t - 1) / t * S) == pytest.approx(1 / 12, rel=1e-12)


def test_step_bytes_grow_by_one_gather_per_block_and_micro_batch(runs):
    dirs, _ = runs
    L, B, T, h, grad_acc, t = 2, 4, 32, 32, 2, 2                  # text_argv's model, float64
    S = B * T * h * 8
    plain, pa, offload = (read_metrics(dirs[name]) for name in ("plain", "pa", "pa_offload"))
    for a, b, c in zip(plain, pa, offload):
        assert b["comm_bytes"] - a["comm_bytes"] == pytest.approx(grad_acc * L * (t - 1) / t * S, rel=1e-12)
        assert c["comm_bytes"] == b["comm_bytes"]
        # what each run keeps of the block inputs, over the offloaded run (which keeps none on the device):
        # the unpartitioned recompute all L inputs, Pa exactly 1/t of them
        assert a["act_bytes"] - c["act_bytes"] == L * S and (b["act_bytes"] - c["act_bytes"]) * t == L * S


@pytest.mark.parametrize("script,world,flags,message", [
    ("train_tp", 2, dict(tp=2, offload_activations=True), "give both"),
    ("train_tp", 2, dict(tp=2, partition_activations=True), "give --recompute full"),
    ("train_tp", 2, dict(tp=2, sp=True, partition_activations=True, recompute="full"), "already split"),
    ("train_5d", 2, dict(dp=2, tp=1, partition_activations=True, recompute="full"), "needs --tp > 1"),
    ("train_5d", 4, dict(dp=2, tp=2, zero_stage=3, partition_activations=True, recompute="full"), "without ZeRO-3"),
])
def test_bad_combinations_fail_early(tiny_data, tmp_path, monkeypatch, capsys, script, world, flags, message):
    import importlib
    from train_helpers import tiny_argv
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(script).main(tiny_argv(tiny_data, str(tmp_path), **flags))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.startswith("error:") and message in err and "\n" not in err, err


def _5d_worker(rank, n, argv):
    import train_5d
    train_5d.main(argv)


def test_5d_pipeline_with_pa_matches_single_float64(text_data, text_reference, tmp_path):
    """tp 2 x pp 2 (1f1b): the pipeline's backward actions recompute each stage's blocks from gathered parts."""
    out = str(tmp_path / "tp2pp2")
    run_workers(_5d_worker, 4, args=(text_argv(text_data, out, tp=2, pp=2, micro_batch_size=2, recompute="full",
                                               partition_activations=True),), timeout=900)
    assert_exact(text_reference[0], curves(out))


def _offload_streams(rank, n, n_layer, micro_batches):
    """n_layer blocks under Pa with offload, the GPU path taken on a CPU with tests/fake_streams.py in place of
    torch.cuda: (the fake's log, host buffers in the pool afterwards, max |grad difference| with plain blocks)."""
    import contextlib
    import copy
    import torch.distributed as dist
    import model as M
    from converters import partition_activations as pa
    from fake_streams import FakeCuda
    dist.init_process_group("gloo")
    cuda, pool = FakeCuda(), pa.HostBuffers()
    pa.COPIES, pa.HOST_BUFFERS = pa.Copies(cuda), pool
    pa.COPIES.on_gpu = lambda device: True
    cfg = M.GPTConfig(vocab_size=64, block_size=8, n_layer=n_layer, n_head=2, n_embd=16)
    torch.manual_seed(0)
    plain = M.GPT(cfg).double()
    gpt = copy.deepcopy(plain)
    pa.partition_activations(gpt.transformer.h, dist.group.WORLD, offload=True)
    rope = M.rope_cache(8, torch.arange(8)).double()
    for model, record in ((plain, False), (gpt, True)):
        for mb in range(micro_batches):
            y = torch.randn(2, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(mb))
            with cuda.recording() if record else contextlib.nullcontext():
                for block in model.transformer.h:
                    y = block(y, rope)
                y.square().sum().backward()
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(plain.parameters(), gpt.parameters())
               if p.grad is not None)
    return cuda.log, len(pool.free), diff


def test_offload_copies_run_on_a_side_stream_ordered_by_one_event_each():
    """Checked on the GPU path with a fake stream recorder: each copy out is queued on the side stream after an
    event of the compute stream (the compute stream never waits for it); in each recompute the compute stream waits
    for the event of its own part's copy back only, and the block before's copy back is queued right after, to travel
    during this block's recompute and backward; the host buffers are reused (n_layer of them for two micro-batches);
    the gradients equal the plain blocks'."""
    n_layer, micro_batches = 3, 2
    log, buffers, diff = run_workers(_offload_streams, 1, args=(n_layer, micro_batches), timeout=120)[0]
    assert diff < 1e-12
    assert buffers == n_layer                            # one per part in flight, reused by the next micro-batch
    assert not [entry for entry in log if entry[0] == "compute" and entry[1].startswith("copy")]
    outs = [i for i, entry in enumerate(log) if entry[1] == "copy out"]
    assert len(outs) == n_layer * micro_batches
    for i in outs:                                       # record on compute, side waits for that event, copy
        assert log[i - 2][:2] == ("compute", "record") and log[i - 1] == ("side", "wait", log[i - 2][2]), log[i - 2:i]
    backs = [i for i, entry in enumerate(log) if entry[1] == "copy back"]
    waits = [i for i, entry in enumerate(log) if entry[:2] == ("compute", "wait")]
    assert len(backs) == len(waits) == n_layer * micro_batches
    for back, wait in zip(backs, waits):                 # the event recorded right after this copy, and no other
        assert log[back + 1][:2] == ("side", "record") and log[wait][2] == log[back + 1][2], log[back:wait + 1]
    for mb in range(micro_batches):                      # the block before's copy is queued after this block's wait
        ours = slice(mb * n_layer, (mb + 1) * n_layer)
        assert all(w < b for w, b in zip(waits[ours][:-1], backs[ours][1:])), (waits, backs)
