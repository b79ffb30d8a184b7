"""
partition_activations.py: ZeRO-R's partitioned activation checkpointing, Pa (Rajbhandari et al. 2020, section 6.1;
DeepSpeed's activation checkpointing with partition_activations), for tensor parallelism without SP.

    python -m torch.distributed.run --nproc_per_node 2 train_tp.py --tp 2 --recompute full --partition_activations
        ... --offload_activations        # Pa+cpu: the kept slice waits in (pinned) host memory

With --recompute full a block keeps only its input x [b, s, h] for backward. Under TP without SP that input is
replicated: every TP rank keeps the same b*s*h values. Pa keeps this rank's 1/t of them (x flattened, cut in t
equal parts) and all-gathers the t parts just before the block is recomputed in backward (train_tp.py draws it):

    forward   block i: x (whole, every rank) -> run the block without keeping anything -> keep my part x_r (1/t)
    backward  block i: all-gather x_0..x_t-1 -> x -> recompute the block -> its backward -> drop x

Saved bytes per block and micro-batch: b*s*h*bytes/t instead of b*s*h*bytes. Traffic: one all-gather of the block
input, (t-1)/t * b*s*h*bytes, against TP's own six all-reduces per block with recompute (2 forward, 2 recomputed,
2 backward) of 2(t-1)/t each: 1/12 of it, the paper's "under 10%". (Measured against this project's plain
--recompute full, Pa also adds one all-reduce: its recompute runs the whole block, as Megatron's checkpoint that the
analysis assumes does, while torch's non-reentrant checkpoint stops before the block's last all-reduce, whose output
backward does not need; tests/test_partition_activations.py counts both.) --offload_activations moves the part to host
memory as it is made and copies it back asynchronously: the backward of block i starts the copy of the block
before it (block i-1's part), so it travels while block i recomputes.

The block runs as a reentrant checkpoint (an autograd Function that keeps the part as its saved tensor, counted by
metrics.SavedActivationBytes), so the model's own recompute must be off where this is on: the rung sets the model
config's recompute to "none" and wraps the blocks here. The random state (dropout) and autocast of the forward are
restored for the recompute, as torch.utils.checkpoint does. Imports only torch and comm.py.
"""
import contextlib

import torch
import torch.distributed as dist

from common.comm import all_gather


class HeldPart:
    """This rank's 1/t of a block input, kept for backward: on the device (saved by autograd), or offloaded to host
    memory (pinned where there is a GPU) and fetched back before use. `before`: the block forwarded just before this
    one, whose part the backward prefetches (offload only)."""

    def __init__(self, part, offload, before):
        self.device, self.offload, self.before, self.fetched, self.host = part.device, offload, before, None, None
        if offload:
            self.host = torch.empty(part.shape, dtype=part.dtype, pin_memory=part.is_cuda)
            self.host.copy_(part, non_blocking=part.is_cuda)

    def prefetch(self):
        """Start the copy back (once; a part already used, by an earlier micro-batch, has nothing to copy)."""
        if self.offload and self.fetched is None and self.host is not None:
            self.fetched = self.host.to(self.device, non_blocking=True)

    def take(self, saved):
        """The part on the device: autograd's saved tensor, or the host copy brought back."""
        if not self.offload:
            return saved
        self.prefetch()
        part, self.fetched, self.host = self.fetched, None, None
        return part


def my_part(x, group):
    """x flattened and zero-padded to a multiple of t, then this rank's 1/t of it (a copy: x itself can be freed)."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    flat = x.detach().reshape(-1)
    size = -(-flat.numel() // t)
    flat = torch.nn.functional.pad(flat, (0, size * t - flat.numel()))
    return flat[r * size:(r + 1) * size].clone()


def gather_whole(part, group, shape):
    """The t parts all-gathered over the group, cut back to the input's shape."""
    whole = part.new_empty(part.numel() * dist.get_world_size(group))
    all_gather(whole, part, group=group)
    return whole[:shape.numel()].view(shape)


def random_state(device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def replayed(state, device, autocast):
    """The forward's random state and autocast again, the caller's random stream untouched afterwards."""
    cpu, gpu = state
    with torch.random.fork_rng([device] if device.type == "cuda" else [], device_type=device.type):
        torch.set_rng_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state(gpu, device)
        with torch.autocast(device.type, dtype=autocast[1], enabled=autocast[0]):
            yield


class PartitionedRecompute(torch.autograd.Function):
    """A block run without keeping its activations; backward gathers its input from the t parts and recomputes."""

    @staticmethod
    def forward(ctx, x, rope, block, group, chain):
        ctx.block, ctx.group, ctx.chain, ctx.rope, ctx.shape = block, group, chain, rope, x.shape
        ctx.random = random_state(x.device)
        ctx.autocast = (torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        out = block(x, rope)                           # (grad is off inside a Function's forward: nothing kept)
        part = my_part(x, group)
        ctx.held = chain.hold(part)
        ctx.save_for_backward(None if chain.offload else part)
        return out

    @staticmethod
    def backward(ctx, grad):
        held = ctx.held
        part = held.take(ctx.saved_tensors[0])
        if held.before is not None:                    # the block before: its part travels during this recompute
            held.before.prefetch()
            held.before = None                         # (no chain of old parts kept alive)
        x = gather_whole(part, ctx.group, ctx.shape).detach().requires_grad_()
        with torch.enable_grad(), replayed(ctx.random, x.device, ctx.autocast), ctx.chain.recomputing():
            out = ctx.block(x, ctx.rope)
        torch.autograd.backward(out, grad)             # parameter grads accumulate as in any backward
        return x.grad, None, None, None, None


class PartitionChain:
    """What the wrapped blocks of one model share: the group, offload, the last part held (the prefetch order) and
    whether a recompute is running (then a block runs plainly)."""

    def __init__(self, group, offload):
        self.group, self.offload, self.last, self.in_recompute = group, offload, None, False

    def hold(self, part):
        self.last = HeldPart(part, self.offload, self.last if self.offload else None)
        return self.last

    @contextlib.contextmanager
    def recomputing(self):
        self.in_recompute = True
        try:
            yield
        finally:
            self.in_recompute = False


def partition_activations(blocks, group, offload=False):
    """Make each block (called as block(x, rope)) keep 1/t of its input over `group` while training, in place: its
    forward is wrapped, its parameters and their names stay. The model's own recompute must be off."""
    chain = PartitionChain(group, offload)
    for block in blocks:
        plain = block.forward

        def forward(x, rope, block=block, plain=plain):
            if not (block.training and torch.is_grad_enabled()) or chain.in_recompute:
                return plain(x, rope)
            return PartitionedRecompute.apply(x, rope, block, group, chain)
        block.forward = forward
    return chain


# ----------------------------------------------------------------------------------------------------------
# the flags, for train_tp.py and train_5d.py

def add_partition_args(parser):
    parser.add_argument("--partition_activations", action="store_true",
                        help="ZeRO-R's Pa with --recompute full under TP without SP: keep 1/tp of each block's input, "
                             "all-gather it before the recompute (common/partition_activations.py)")
    parser.add_argument("--offload_activations", action="store_true",
                        help="with --partition_activations: keep the 1/tp part in (pinned) host memory")


def check_partition_args(cfg, tp):
    """The layouts Pa is for (and was checked in), as one error line each."""
    from common.errors import check
    from common.pipeline_schedules import SPLIT_BACKWARD
    check(cfg.partition_activations or not cfg.offload_activations,
          "--offload_activations offloads the parts --partition_activations keeps: give both")
    if not cfg.partition_activations:
        return
    check(cfg.recompute == "full", "--partition_activations partitions the block inputs --recompute full keeps: "
                                   f"give --recompute full (got {cfg.recompute})")
    check(tp > 1, "--partition_activations splits each block input over the TP ranks: it needs --tp > 1")
    check(not cfg.sp, "--partition_activations is for TP without --sp: with SP every activation, the block input "
                      "too, is already split over the TP ranks")
    check(not cfg.compile, "--partition_activations wraps each block's forward in a Python autograd Function: "
                           "leave out --compile")
    check(getattr(cfg, "zero_stage", 0) < 3 and getattr(cfg, "n_experts", 0) == 0
          and getattr(cfg, "pp_schedule", "1f1b") not in SPLIT_BACKWARD,
          "--partition_activations is checked without ZeRO-3, MoE blocks and the split-backward schedules "
          f"({', '.join(SPLIT_BACKWARD)})")
