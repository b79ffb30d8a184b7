"""Split backward under tensor parallelism (zb1, zbv, dualpipev in train_5d with --tp): the column- and row-parallel
layers and the vocab-parallel LM head, handed a WeightGradStore, return the input gradient in B with its TP
communication and leave the weight gradients for W, which then equal the plain backward's (float64)."""
import torch

from distributed_helper import run_workers


def _split_equals_plain(rank, world, sp):
    import torch.distributed as dist
    from common.comm import COMM
    from common.pipeline_weight_grads import WeightGradStore, defer_weight_grads
    from train_tp import ColumnParallelLinear, RowParallelLinear
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    out = {}
    for split in (False, True):
        torch.manual_seed(0)
        layers = torch.nn.Sequential(ColumnParallelLinear(8, 12, group, sp=sp, dtype=torch.float64),
                                     RowParallelLinear(12, 8, group, sp=sp, dtype=torch.float64))
        for p in layers.parameters():
            torch.nn.init.normal_(p)
        store = WeightGradStore()
        if split:
            defer_weight_grads(layers, store)
        x = torch.randn(2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        local = x.chunk(world, dim=1)[rank] if sp else x                 # SP: my sequence chunk
        COMM.reset()
        layers(local).square().sum().backward()
        after_b = [n for n, p in layers.named_parameters() if p.grad is not None]
        out[split] = dict(dx=x.grad.tolist(), bytes=COMM.bytes_sent, after_b=after_b)
        if split:
            store.close("mb")
            store.compute("mb")
        out[split]["grads"] = {n: p.grad.tolist() for n, p in layers.named_parameters()}   # (plain data: the
    return out                                                                 # worker exits before it is read)


def test_split_backward_under_tp_defers_weight_grads():
    for sp in (False, True):
        for r in run_workers(_split_equals_plain, 2, args=(sp,)):
            plain, split = r[False], r[True]
            assert torch.allclose(torch.tensor(split["dx"]), torch.tensor(plain["dx"]), rtol=1e-12, atol=0)
            assert split["bytes"] == plain["bytes"] > 0                  # B keeps TP's communication
            # B left the matmul weights (and the column bias) to W; the row bias is added after the sum: autograd's
            assert split["after_b"] == ["1.bias"] and len(plain["after_b"]) == 4
            for name, g in plain["grads"].items():
                assert torch.allclose(torch.tensor(split["grads"][name]), torch.tensor(g), rtol=1e-12, atol=1e-12), name
