"""
bf16 copies of the weights under autocast, counted on a CPU (DESIGN.md, "Tests"): autocast casts each fp32 weight to
bf16 for its matmul and the matmul saves that copy for backward, so a copy lives as long as the graph of the
micro-batch that made it. Autocast caches the cast (one copy per weight) only until its outermost region exits: a
region per pipeline action casts again for every micro-batch while the earlier ones' graphs still hold their copies,
one copy of the stage's weights per in-flight micro-batch (m of them under AFAB, p at stage 0 under 1F1B).

LiveWeightCopies counts, for each weight shape (or its transpose), the distinct 16-bit tensors of that shape autograd
holds at once; the check is that the peak never exceeds the number of weights of that shape the rank holds, whatever
the number of micro-batches in flight. ZeRO-3 saves its casts through a saved-tensors hook of its own (autograd runs
one pair at a time), so LiveCasts counts there instead: every 16-bit cast of a weight's shape still alive, however
it is held; ZeRO-3 may hold the casts of two blocks (the one computing and the one prefetched), not of all.
"""
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from distributed_helper import run_workers
from train_helpers import tiny_argv

H, VOCAB = 48, 64      # weight shapes (3h x h, 4h x h, ...) that no activation of the runs below has


class _Held:
    def __init__(self, tensor, counter, key):
        self.tensor, self.counter, self.key = tensor, counter, key
        counter.hold(key)

    def __del__(self):
        self.counter.release(self.key)


class LiveWeightCopies:
    """Peak number of distinct 16-bit saved tensors alive at once, per weight shape (a saved-tensors hook)."""

    def __init__(self, shapes):
        self.shapes, self.holders, self.peak = {tuple(sorted(s)) for s in shapes}, {}, {}

    def hold(self, key):
        self.holders[key] = self.holders.get(key, 0) + 1
        shape = key[1]
        live = sum(1 for k in self.holders if k[1] == shape)
        self.peak[shape] = max(self.peak.get(shape, 0), live)

    def release(self, key):
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]

    def pack(self, t):
        shape = tuple(sorted(t.shape))        # a matmul may save the weight's transpose: shapes compared unordered
        if t.dtype in (torch.bfloat16, torch.float16) and shape in self.shapes:
            return _Held(t, self, (t.untyped_storage().data_ptr(), shape))
        return t

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held


def weight_shapes(params):
    shapes = {}
    for p in params:
        if p.dim() == 2:
            shape = tuple(sorted(p.shape))
            shapes[shape] = shapes.get(shape, 0) + 1
    return shapes


def pipeline_copies(rank, world_size, argv):
    """A worker: train_pp under bf16 autocast; (peak live copies per weight shape, weights per shape) of this rank."""
    import train_pp
    pad = (VOCAB + 63) // 64 * 64
    counter = LiveWeightCopies([(3 * H, H), (H, H), (4 * H, H), (H, 4 * H), (pad, H)])
    forward, held = train_pp.PipelineRunner._forward, []

    def received_bytes_kept(runner, *args):          # 16-bit received inputs held until their backward
        forward(runner, *args)
        held.append(sum(inp.untyped_storage().nbytes() for inp, _ in runner.saved.values() if inp.is_floating_point()))
    train_pp.PipelineRunner._forward = received_bytes_kept
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        result = train_pp.main(argv)
    return counter.peak, weight_shapes(result["chunks"].parameters()), held


@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
def test_pipeline_keeps_one_bf16_copy_per_weight(schedule, tiny_data, tmp_path):
    argv = tiny_argv(tiny_data, str(tmp_path), dtype="bfloat16", n_embd=H, n_head=4, n_layer=2, pp=2,
                     pp_schedule=schedule, n_microbatches=4, global_batch_size=8, max_steps=2)
    for rank, (peak, held, received) in enumerate(run_workers(pipeline_copies, 2, args=(argv,))):
        assert peak, f"rank {rank}: no bf16 weight copy seen (is autocast on?)"
        # stage 1's bf16 receive buffers: freed once the stage took its fp32 copy (backward needs only their .grad)
        assert received and set(received) == {0}, (rank, received)
        for shape, n in peak.items():
            assert n <= held.get(shape, 0), (f"rank {rank}: {n} bf16 copies of the {shape} weights alive at once, "
                                             f"{held.get(shape, 0)} such weights held ({schedule}, 4 micro-batches)")


class LiveCasts(TorchDispatchMode):
    """Peak number of 16-bit casts of a weight shape alive at once, however they are held (saved for backward,
    autocast's cache, a saved-tensors hook's own storage): every aten._to_copy to 16 bits of that shape is watched
    by a weak reference to its memory, and the live ones are counted after every operation."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.live, self.peak = tuple(sorted(shape)), [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and out.dtype in (torch.bfloat16, torch.float16)
                and tuple(sorted(out.shape)) == self.shape):
            self.live.append(StorageWeakRef(out.untyped_storage()))
        self.live = [ref for ref in self.live if not ref.expired()]
        self.peak = max(self.peak, len(self.live))
        return out


def zero3_copies(rank, world_size, argv):
    """A worker: train_zero stage 3 under bf16 autocast; the peak number of live bf16 casts of c_attn's weight."""
    import train_zero
    gather, in_flight = train_zero.Shard.gather, []

    def gather_watched(shard, dtype=None):           # a 16-bit gather in flight holds no fp32 buffer yet
        launched = shard.handle is None
        gather(shard, dtype)
        if launched and shard.handle is not None and dtype in (torch.bfloat16, torch.float16):
            in_flight.append(shard.full.untyped_storage().nbytes())
    train_zero.Shard.gather = gather_watched
    with LiveCasts((3 * H, H)) as casts:
        train_zero.main(argv)
    return casts.peak, in_flight


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_zero3_keeps_bf16_copies_of_at_most_two_blocks(recompute, tiny_data, tmp_path):
    """ZeRO-3 holds at most the block being computed and the one prefetched; its bf16 casts are no more
    (comm.CastsFreedWithParams: no autocast cache, a saved cast is cast again in backward). Under full recompute
    the casts are not saved, but autocast's cache alone would hold every block's until the forward ends."""
    argv = tiny_argv(tiny_data, str(tmp_path), dtype="bfloat16", n_embd=H, n_head=4, n_layer=4, zero_stage=3,
                     global_batch_size=8, micro_batch_size=4, max_steps=1, recompute=recompute)
    for rank, (peak, in_flight) in enumerate(run_workers(zero3_copies, 2, args=(argv,))):
        assert 0 < peak <= 2, f"rank {rank}: bf16 casts of {peak} blocks' c_attn weight alive at once (4 blocks)"
        assert in_flight and set(in_flight) == {0}, (rank, in_flight)   # the fp32 buffer comes at wait()
