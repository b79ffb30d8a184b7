"""
converters/partition_activations.py: ZeRO-R's partitioned activation checkpointing, Pa (Rajbhandari et al. 2020,
section 6.1; DeepSpeed's activation checkpointing with partition_activations), for tensor parallelism without SP.

    torchrun --nproc_per_node 2 train_tp.py --tp 2 --recompute full --partition_activations
    torchrun --nproc_per_node 2 train_tp.py --tp 2 --recompute full --partition_activations --offload_activations

With --recompute full a block keeps only its input x [b, s, h] for backward. Under TP without SP that input is
replicated: every TP rank keeps the same b*s*h values. Pa keeps this rank's 1/t of them (x flattened, cut in t
equal parts) and all-gathers the t parts just before the block is recomputed in backward:

    forward   block i: x (whole, every rank) -> run the block without keeping anything -> keep my part x_r (1/t)
    backward  block i: all-gather x_0..x_t-1 -> x -> recompute the block -> its backward -> drop x

Saved bytes per block and micro-batch: b*s*h*bytes/t instead of b*s*h*bytes. Traffic: one all-gather of the block
input, (t-1)/t * b*s*h*bytes, against TP's own six all-reduces per block with recompute (2 forward, 2 recomputed,
2 backward) of 2(t-1)/t each: 1/12 of it, the paper's "under 10%" (torch's checkpoint, used here, even stops its
recompute before the block's last all-reduce, whose output backward does not need). --offload_activations moves
the part to host memory as it is made (Pa+cpu) and copies it back, both on a side stream ordered by one event per
copy (HeldInput): the copy out overlaps the next block's forward, and the recompute of block i starts the copy back
of the block before it (block i-1's part), so it travels while block i recomputes and runs its backward. Host
buffers are reused (HostBuffers): as many as parts are in flight, not one per part ever offloaded.
SP makes Pa unnecessary: between blocks the activations are already cut by sequence (T/t each), so the block input
is kept split at no cost, and its all-gather is the one SP's f does anyway.

Each block runs under torch.utils.checkpoint (non-reentrant: it restores the random state and autocast for the
recompute), which reaches the input only through a HeldInput, so it keeps nothing of it; the part is kept for
backward by an identity autograd Function (metrics.SavedActivationBytes counts it). The model's own recompute must
be off where this is on: the rung sets the model config's recompute to "none" and wraps the blocks here. Imports
only torch and comm.py.
"""
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from common.comm import all_gather


class HeldInput:
    """A block's input as its checkpoint sees it: the input itself during the forward, afterwards only this rank's
    1/t part, on the device or offloaded to host memory (pinned where there is a GPU). `before`: the block forwarded
    just before this one, whose part this one's recompute starts copying back (offload only).

    On a GPU both copies run on a side stream (Copies), each ordered by events, one per copy: the copy out waits for
    the event of the part being made, so the compute stream never waits for it; the compute stream waits only for
    the event of its own part's copy back, not for the whole side stream (where the block before's copy, queued
    next, is still to run)."""

    def __init__(self, x, group, offload, before):
        self.x, self.group, self.shape, self.offload, self.before = x, group, x.shape, offload, before
        self.part, self.host, self.device, self.back = my_part(x, group), None, x.device, None
        if offload:
            self.host = HOST_BUFFERS.take(self.part)
            if COPIES.on_gpu(self.device):
                COPIES.copy_out(self.host, self.part)
            else:
                self.host.copy_(self.part)
            self.part = None

    def prefetch(self):
        """Start the copy back (once; a part already used, by an earlier micro-batch, has nothing to copy). On a GPU
        it runs on the side stream, so it overlaps the compute queued meanwhile; `back` is its event."""
        if self.part is not None or self.host is None:
            return
        if COPIES.on_gpu(self.device):
            self.part, self.back = COPIES.copy_back(self.host, self.device)
        else:                                          # (a copy even on a CPU: the buffer goes back to the pool)
            self.part = self.host.to(self.device, copy=True)
        HOST_BUFFERS.give(self.host, self.back)        # reusable once the copy back has read it
        self.host = None

    def whole(self):
        """The forward's input; in the recompute, the t parts all-gathered (requiring grad, as the input did, so
        autograd saves the same tensors as the first time)."""
        if self.x is not None:
            return self.x
        self.prefetch()
        if self.back is not None:                      # the compute stream waits for this copy only, and owns it
            COPIES.use(self.part, self.back, self.device)
        if self.before is not None:                    # the block before: its part travels during this recompute
            self.before.prefetch()
            self.before = None                         # (no chain of old parts kept alive)
        part, self.part = self.part, None              # (autograd still holds it until this block's backward)
        return gather_whole(part, self.group, self.shape).requires_grad_(True)


class Copies:
    """The offload's CUDA stream work: one side stream per GPU, an event per copy. `cuda`: torch.cuda (a test
    passes a recorder with the same calls: tests/fake_streams.py)."""

    def __init__(self, cuda=torch.cuda):
        self.cuda, self.streams = cuda, {}

    def on_gpu(self, device):
        return device.type == "cuda"

    def side(self, device):
        """One side stream per GPU for the copies (created on first use)."""
        if device not in self.streams:
            self.streams[device] = self.cuda.Stream(device)
        return self.streams[device]

    def copy_out(self, host, part):
        """part -> host on the side stream, once the compute stream has made part (an event); part's memory is not
        handed out again by the caching allocator until the side stream has read it (record_stream)."""
        compute, side = self.cuda.current_stream(part.device), self.side(part.device)
        made = self.cuda.Event()
        made.record(compute)
        side.wait_event(made)
        with self.cuda.stream(side):
            host.copy_(part, non_blocking=True)
        part.record_stream(side)

    def copy_back(self, host, device):
        """(host -> a new device tensor on the side stream, the event recorded right after that copy)."""
        side = self.side(device)
        with self.cuda.stream(side):
            part = host.to(device, non_blocking=True)
        done = self.cuda.Event()
        done.record(side)
        return part, done

    def use(self, part, done, device):
        """The compute stream waits for the copy that made `part` (its event only), and takes over its memory."""
        compute = self.cuda.current_stream(device)
        compute.wait_event(done)
        part.record_stream(compute)


class HostBuffers:
    """The host buffers parts are offloaded into (pinned where there is a GPU), reused: a buffer comes back with the
    event of the copy that last read it (None: read already) and is handed out again once that event has passed. So
    the pool holds at most the parts in flight at once (blocks x micro-batches between a forward and its backward),
    not one buffer per part ever offloaded."""

    def __init__(self):
        self.free = []                                 # (buffer, event or None)

    def take(self, like):
        for i, (buffer, done) in enumerate(self.free):
            if buffer.shape == like.shape and buffer.dtype == like.dtype and (done is None or done.query()):
                return self.free.pop(i)[0]
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)

    def give(self, buffer, done):
        self.free.append((buffer, done))


COPIES, HOST_BUFFERS = Copies(), HostBuffers()


class KeepForBackward(torch.autograd.Function):
    """Identity on x that saves `part`: autograd owns the part until this block's backward (and
    metrics.SavedActivationBytes counts it, as any tensor kept for backward)."""

    @staticmethod
    def forward(ctx, x, part):
        ctx.save_for_backward(part)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


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


def partition_activations(blocks, group, offload=False):
    """Make each block (called as block(x, rope)) keep 1/t of its input over `group` while training, in place: its
    forward is wrapped, its parameters and their names stay. The model's own recompute must be off."""
    last = [None]                                      # the HeldInput of the block forwarded last

    def wrap(block, plain):
        def forward(x, rope):
            if not (block.training and torch.is_grad_enabled()):       # eval, sampling: nothing to keep
                return plain(x, rope)
            held = HeldInput(x, group, offload, last[0] if offload else None)
            if held.part is not None:
                x = KeepForBackward.apply(x, held.part)
            held.x = x
            # torch's non-reentrant checkpoint: keeps no tensor of the block, replays its random state and autocast,
            # and reaches the input only through `held` (an argument it would keep whole)
            out = checkpoint(lambda h, r: plain(h.whole(), r), held, rope, use_reentrant=False)
            held.x, last[0] = None, held
            return out
        return forward

    for block in blocks:
        block.forward = wrap(block, block.forward)


# ----------------------------------------------------------------------------------------------------------
# the flags, for train_tp.py and train_5d.py

def apply_partition_flags(cfg, model_cfg, blocks, group):
    """--partition_activations on model.py's blocks: Pa then recomputes them, in place of model_cfg's recompute."""
    if cfg.partition_activations:
        model_cfg.recompute = "none"
        partition_activations(blocks, group, cfg.offload_activations)


def add_partition_args(parser):
    parser.add_argument("--partition_activations", action="store_true",
                        help="ZeRO-R's Pa with --recompute full under TP without SP: keep 1/tp of each block's input, "
                             "all-gather it before the recompute (converters/partition_activations.py)")
    parser.add_argument("--offload_activations", action="store_true",
                        help="with --partition_activations: keep the 1/tp part in (pinned) host memory")


def check_partition_args(cfg, tp):
    """The layouts Pa is for (and was checked in), as one error line each."""
    from common.errors import check
    from pipeline.schedules import SPLIT_BACKWARD
    partition = getattr(cfg, "partition_activations", False)     # a Config made in code has neither flag
    check(partition or not getattr(cfg, "offload_activations", False),
          "--offload_activations offloads the parts --partition_activations keeps: give both")
    if not partition:
        return
    check(cfg.recompute == "full", "--partition_activations partitions the block inputs --recompute full keeps: "
                                   f"give --recompute full (got {cfg.recompute})")
    check(tp > 1, "--partition_activations splits each block input over the TP ranks: it needs --tp > 1")
    check(not cfg.sp, "--partition_activations is for TP without --sp: with SP every activation, the block input "
                      "too, is already split over the TP ranks")
    check(not cfg.compile, "--partition_activations wraps each block's forward in Python state (its part, the "
                           "gather) the compiler is not checked with: leave out --compile")
    check(getattr(cfg, "zero_stage", 0) < 3 and getattr(cfg, "n_experts", 0) == 0
          and getattr(cfg, "pp_schedule", "1f1b") not in SPLIT_BACKWARD,
          "--partition_activations is checked without ZeRO-3, MoE blocks and the split-backward schedules "
          f"({', '.join(SPLIT_BACKWARD)})")
