"""train_tp.py: parallel layers equal their dense versions, training equals train_single.py, counted bytes and
parameters equal theory, activation memory shrinks as Korthikanti et al. predict, bad input fails early.

Three spawns in all (worlds 3, 2, 4); each runs several configurations in one process group."""
import pytest
import torch
import torch.nn.functional as F

from distributed_helper import run_workers
from model import GPTConfig, num_params
from train_helpers import assert_same_losses, assert_same_weights, losses, run_single, tiny_argv
from metrics import read_metrics

TINY = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, micro_batch_size=4, global_batch_size=8, vocab=64)


def _numpy(tensors):
    return {n: t.detach().cpu().numpy() for n, t in tensors.items()}   # tensors would travel as shared memory


# ----------------------------------------------------------------------------------------------------------
# unit: each parallel layer against its dense version, on odd sizes (tp=3, 7 input features, 6 tokens x 3)

def _rel_err(a, b):
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def _layers_worker(rank, n):
    import torch.distributed as dist
    import train_tp as tp
    from comm import all_reduce
    dist.init_process_group("gloo")
    g, errs = dist.group.WORLD, {}

    def record(key, got, ref):
        errs[key] = max(errs.get(key, 0.0), _rel_err(got, ref))

    def seq(t, sp):                                  # this rank's sequence chunk under SP, else everything
        return t.chunk(n, 1)[rank] if sp else t

    for dtype in (torch.float64, torch.float32):
        gen = torch.Generator().manual_seed(0)
        rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype)      # noqa: E731
        B, T = 3, 6
        # column-parallel (q|k|v layout: 3 parts) and row-parallel linears
        for name, fan_in, fan_out in (("column", 7, 9), ("row", 9, 5)):
            x, w, b, gy = rnd(B, T, fan_in), rnd(fan_out, fan_in), rnd(fan_out), rnd(B, T, fan_out)
            xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
            yr = F.linear(xr, wr, br)
            (yr * gy).sum().backward()
            modes = [(False, False), (False, True), (True, False), (True, True)] if name == "column" else \
                [(False, False), (True, False)]
            for sp, overlap in modes:
                key = f"{dtype}/{name}/sp={sp}/overlap={overlap}"
                if name == "column":
                    layer = tp.ColumnParallelLinear(fan_in, fan_out, g, sp, overlap, parts=3).to(dtype)
                    shard = lambda t, dim: tp.shard_of(t, dim, 3, rank, n)       # noqa: E731
                    wdim, xin, bias_ref = 0, x, shard(b, 0)
                    y_ref, gy_mine = shard(yr, 2), shard(gy, 2)     # full sequence, my features
                else:
                    layer = tp.RowParallelLinear(fan_in, fan_out, g, sp).to(dtype)
                    shard = lambda t, dim: tp.shard_of(t, dim, 1, rank, n)       # noqa: E731
                    wdim, xin, bias_ref = 1, shard(x, 2), b
                    y_ref, gy_mine = seq(yr, sp), seq(gy, sp)
                with torch.no_grad():
                    layer.weight.copy_(shard(w, wdim))
                    layer.bias.copy_(bias_ref)
                xin = seq(xin, sp if name == "column" else False).clone().requires_grad_()
                y = layer(xin)
                record(key + "/out", y, y_ref)
                (y * gy_mine).sum().backward()
                gx_ref = seq(xr.grad, sp) if name == "column" else shard(xr.grad, 2)
                record(key + "/grad_x", xin.grad, gx_ref)
                record(key + "/grad_w", layer.weight.grad, shard(wr.grad, wdim))
                if name == "row" and sp:             # replicated bias, partial grad per sequence chunk
                    all_reduce(layer.bias.grad, group=g)
                record(key + "/grad_b", layer.bias.grad, shard(br.grad, 0) if name == "column" else br.grad)
        # vocab-parallel embedding: 15 rows over 3 ranks
        V, D = 15, 7
        idx, w, gy = torch.randint(0, V, (B, T), generator=gen), rnd(V, D), rnd(B, T, D)
        wr = w.clone().requires_grad_()
        yr = F.embedding(idx, wr)
        (yr * gy).sum().backward()
        for sp in (False, True):
            emb = tp.VocabParallelEmbedding(V, D, g, sp).to(dtype)
            with torch.no_grad():
                emb.weight.copy_(tp.shard_of(w, 0, 1, rank, n))
            y = emb(idx)
            record(f"{dtype}/embedding/sp={sp}/out", y, seq(yr, sp))
            (y * seq(gy, sp)).sum().backward()
            record(f"{dtype}/embedding/sp={sp}/grad_w", emb.weight.grad, tp.shard_of(wr.grad, 0, 1, rank, n))
        # vocab-parallel cross-entropy on logits with a large spread (the max shift matters)
        logits, targets = 10 * rnd(B * T, V), torch.randint(0, V, (B * T,), generator=gen)
        lr_ = logits.clone().requires_grad_()
        loss_ref = F.cross_entropy(lr_, targets)
        (2.5 * loss_ref).backward()
        local = tp.shard_of(logits, 1, 1, rank, n).requires_grad_()
        loss = tp.VocabParallelCrossEntropy.apply(local, targets, rank * V // n, g)
        (2.5 * loss).backward()
        record(f"{dtype}/cross_entropy/loss", loss, loss_ref)
        record(f"{dtype}/cross_entropy/grad", local.grad, tp.shard_of(lr_.grad, 1, 1, rank, n))
    # the per-rank stream: different inside the context, the shared stream identical (and advanced) after it
    torch.manual_seed(5)
    with tp.rank_rng(g, torch.device("cpu")):
        inside = torch.rand(4).tolist()
    return errs, inside, torch.rand(4).tolist()


def test_parallel_layers_equal_dense_layers():
    results = run_workers(_layers_worker, 3)
    for errs, _, _ in results:
        assert len(errs) == 2 * (4 * 4 + 2 * 4 + 2 * 2 + 2)    # dtypes x (layer modes x checked tensors)
        for key, err in errs.items():
            assert err <= (1e-10 if "float64" in key else 2e-6), f"{key}: relative error {err:.1e}"
    inside = [r[1] for r in results]
    after = [r[2] for r in results]
    assert inside[0] != inside[1] != inside[2] and inside[0] != inside[2], "dropout streams must differ per rank"
    assert after[0] == after[1] == after[2], "the shared stream must stay identical on every TP rank"
    torch.manual_seed(5)
    torch.randint(0, 2 ** 62, (1,))                  # the context consumed exactly its one seed draw
    assert after[0] == torch.rand(4).tolist()
