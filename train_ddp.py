"""
train_ddp.py: data parallelism written by hand, over train_single.py. Every rank holds the whole model, runs
its own slice of the global batch, and the gradients are averaged across ranks before the optimizer step.

    torchrun --nproc_per_node 2 train_ddp.py                          # bucketed, overlapped all-reduce
    torchrun --nproc_per_node 4 train_ddp.py --ddp_mode naive         # one blocking all-reduce per tensor
    torchrun --nproc_per_node 2 train_ddp.py --ddp_mode bucket --bucket_mb 1 --global_batch_size 32

The three --ddp_mode values are the three steps of the classic optimization (switchable to measure each):

    naive    backward ................................ | AR p1 | AR p2 | ... | AR pk |  step
    overlap  backward [AR pk] [AR pk-1] ... (async, launched as each grad is final)   | wait | step
    bucket   backward [AR bucket 0 ] [AR bucket 1 ] ...  (few large messages, grads are views of them)

Gradient accumulation: only the last micro-step of an optimizer step synchronizes (the `no_sync` idea);
the decision is made *before* that micro-step's forward, so hooks know whether to communicate.
    global_batch_size = micro_batch_size * grad_acc * dp

Communication per optimizer step (docs/observability.md's convention), P parameters of b bytes, n ranks:
    comm_bytes = 2 (n-1)/n * P * b              in every mode, independent of grad_acc

Two of ZeRO-R's memory lessons (Rajbhandari et al. 2020, section 6) are already here, in bucket mode:
    CB, constant-size buffers: a collective runs on a --bucket_mb buffer, not on one fused copy of all P gradients,
       so its temporary memory stays fixed as the model grows while each message stays large enough to be fast.
    MD, memory defragmentation: the buckets are allocated once, before the first step, and every param.grad is a
       view of one; backward writes gradients into them instead of allocating a tensor each between its short-lived
       temporaries, the holes that fragment a caching allocator (bench/fragmentation.py measures both).
"""
if __name__ == "__main__":      # run as a script: from here on, torch's import included, a Ctrl-C is one line
    from common.errors import report_interrupts
    report_interrupts()
import time
import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from common.comm import COMM, all_reduce, clip_grad_norm

MODES = ("naive", "overlap", "bucket")
REFUSING = dict(hook=None)          # refuse_unfinished_step's handle, registered once per process


# ----------------------------------------------------------------------------------------------------------
# building blocks (train_zero.py, train_ep.py and train_5d.py import these; docs/copy_out.md: with comm.py alone
# they work on any model)

def assign_buckets(params, bucket_bytes):
    """Split `params` (in the order gradients are expected) into consecutive groups of at most
    bucket_bytes; a parameter larger than that gets a bucket of its own."""
    buckets, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class GradBucket:
    """Consecutive parameters whose gradients live in one flat buffer. `pending` counts gradients not yet final
    in this backward."""

    def __init__(self, params):
        self.params = params
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.buffer = None
        self.work = None
        self.pending = len(params)

    def allocate(self):
        if self.buffer is None:
            p = self.params[0]
            self.buffer = torch.zeros(self.numel, dtype=p.dtype, device=p.device)

    def view(self, i):
        """The slice of the flat buffer that holds parameter i's gradient, shaped like the parameter."""
        p = self.params[i]
        return self.buffer[self.offsets[i]: self.offsets[i] + p.numel()].view_as(p)

    def attach_grads(self):
        """Make every param.grad a view into the buffer (allocated if need be): autograd then accumulates straight
        into it."""
        self.allocate()
        for i, p in enumerate(self.params):
            p.grad = self.view(i)


class GradNotInBucket(RuntimeError):
    """A parameter's .grad is no longer the view of its bucket that DataParallelGrads attached."""


class GradsNotFinished(RuntimeError):
    """An optimizer was asked to step on gradients that DataParallelGrads has not averaged yet (no finish())."""


UNFINISHED = weakref.WeakSet()      # the DataParallelGrads whose last synced backward awaits finish()


def refuse_unfinished_step(optimizer, args, kwargs):
    """A step pre-hook on every torch optimizer (registered with the first DataParallelGrads): a step over
    parameters whose gradients a backward produced but finish() has not averaged is refused. Nothing to check
    (an empty set) on every correct step."""
    for grads in UNFINISHED:
        if any(p is q for group in optimizer.param_groups for p in group["params"] for q in grads.params[:1]):
            raise GradsNotFinished("the optimizer would step on this rank's own, unaveraged gradients: call "
                                   "DataParallelGrads.finish() after the last micro-batch's backward, before "
                                   "clipping and optimizer.step()")


class DataParallelGrads:
    """Averages the gradients of `params` over `group` (the building block; not a module wrapper).

    Use: `require_sync(flag)` before each micro-step's forward, `finish()` after the last backward (waits
    for the in-flight reductions and averages), then the optimizer step, then `zero_grad()` of this object,
    never the optimizer's own: in bucket mode every param.grad is a view of a flat buffer, and torch's
    zero_grad() (set_to_none=True) would replace it by a fresh tensor the buckets never see (a GradNotInBucket
    error says so at the next backward; a torch optimizer's step before finish() raises GradsNotFinished). At
    construction the ranks' initial weights are compared once (check_replicas_agree). Subclasses (ZeRO) change
    how the buckets are laid out by overriding `make_buckets`, and what a ready bucket does by overriding
    `grad_landed`, `launch` and `complete`."""

    def __init__(self, params, group, mode="bucket", bucket_mb=25.0):
        assert mode in MODES, mode
        self.params = [p for p in params if p.requires_grad]
        self.group, self.mode = group, mode
        self.n = dist.get_world_size(group)
        self.communicate = self.n > 1       # a one-rank group has nothing to average
        self.sync = True
        self.buckets, self.bucket_of = [], {}
        if mode == "bucket":
            self.buckets = self.make_buckets(bucket_mb)
            self.bucket_of = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.next_bucket = 0             # buckets launch in index order: the same order on every rank
        self.param_works = []
        if self.communicate:
            self.check_replicas()
            if not REFUSING["hook"]:
                REFUSING["hook"] = register_optimizer_step_pre_hook(refuse_unfinished_step)
        for p in self.params:        # every mode: a landed gradient is unfinished until finish()
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def check_replicas(self):
        """Once, at construction: every rank must start from the same weights (not a per-rank seed's). Parameters
        holding no memory are left out: ZeRO-3's, whose Shards compared their values as they were built."""
        held = [p for p in self.params if p.untyped_storage().nbytes() > 0]
        if held:                    # (the same on every rank: ZeRO-3's ranks all hold none)
            check_replicas_agree(held, self.group)

    def make_buckets(self, bucket_mb):
        """The buckets of self.params in launch order, each buffer allocated once and attached as the grads."""
        # backward produces gradients roughly in reverse order of use: last layers' buckets fill first
        buckets = [GradBucket(ps) for ps in assign_buckets(list(reversed(self.params)), bucket_mb * 2 ** 20)]
        for b in buckets:
            b.attach_grads()
        return buckets

    def require_sync(self, flag):
        """Decide, before a micro-step's forward, whether its backward communicates (False = no_sync)."""
        self.sync = flag

    def _grad_ready(self, p):
        """Called by autograd the moment p.grad holds this backward's full gradient."""
        if not self.sync or not self.communicate:
            return
        UNFINISHED.add(self)
        if self.mode == "naive":
            return
        if self.mode == "overlap":
            self.param_works.append(all_reduce(p.grad, group=self.group, async_op=True))
            return
        bucket, i = self.bucket_of[id(p)]
        self.grad_landed(bucket, i, p)
        bucket.pending -= 1
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self.launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def grad_landed(self, bucket, i, p):
        """p's gradient is final: it already sits in the bucket, unless its view was replaced (subclasses that
        lay gradients out otherwise override this)."""
        if p.grad.untyped_storage().data_ptr() != bucket.buffer.untyped_storage().data_ptr():
            raise GradNotInBucket(
                f"a parameter of shape {tuple(p.shape)} got a gradient outside its bucket, so the all-reduce would "
                f"skip it: its .grad, a view of the bucket, was replaced (the optimizer's own zero_grad(), which "
                f"sets grads to None, or a `p.grad = ...`); call DataParallelGrads.zero_grad() instead")

    def launch(self, bucket):
        bucket.work = all_reduce(bucket.buffer, group=self.group, async_op=True)

    def complete(self, bucket):
        if bucket.work is None:
            return
        bucket.work.wait()
        bucket.work = None
        bucket.buffer.div_(self.n)        # sum -> mean over ranks

    def finish(self):
        """Wait for every reduction of this step and average; after it, gradients are identical on all ranks.
        A no-op after a no_sync micro-step."""
        if not self.sync or not self.communicate:
            return
        UNFINISHED.discard(self)
        if self.mode == "naive":
            for p in self.params:
                all_reduce(p.grad, group=self.group)
                p.grad.div_(self.n)
        elif self.mode == "overlap":
            for work in self.param_works:
                work.wait()
            self.param_works = []
            for p in self.params:
                p.grad.div_(self.n)
        else:
            while self.next_bucket < len(self.buckets):      # parameters that got no gradient this step
                self.launch(self.buckets[self.next_bucket])
                self.next_bucket += 1
            for b in self.buckets:
                self.complete(b)
                b.pending = len(b.params)
            self.next_bucket = 0

    def grads(self):
        """The gradient tensors to clip and measure (the flat buffers in bucket mode: fewer, larger ops)."""
        if self.mode == "bucket":
            return [b.buffer for b in self.buckets]
        return [p.grad for p in self.params]

    def zero_grad(self):
        if self.mode == "bucket":
            for b in self.buckets:
                b.buffer.zero_()          # keep the buffers: param.grad are views of them
        else:
            for p in self.params:
                p.grad = None


class ReplicaMismatch(ValueError):
    """Ranks that should hold identical weights do not."""


@torch.no_grad()
def check_replicas_agree(params, group):
    """Cheap start-up check that every rank built the same weights: an exact integer checksum of the bits
    of every parameter, compared across `group` with one all-reduce of [c, -c] under MAX."""
    compare_checksums(weights_checksum(params), group, params[0].device)


def weights_checksum(tensors):
    """An exact integer checksum of the bits of `tensors` (the i-th weighted by i + 1): integer sums are exact in
    any order, so equal tensors give equal checksums on every rank and device."""
    checksum = torch.zeros((), dtype=torch.int64)
    for i, t in enumerate(tensors):
        ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()]
        checksum += (i + 1) * t.detach().reshape(-1).view(ints).to(torch.int64).sum().cpu()
    return checksum


def compare_checksums(checksum, group, device):
    """Raise ReplicaMismatch unless every rank of `group` has the same checksum (one all-reduce of [c, -c])."""
    t = torch.stack([checksum, -checksum]).to(device)
    with COMM.uncounted():                  # a start-up check, not a technique's traffic
        all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if int(t[0]) != -int(t[1]):
        raise ReplicaMismatch(f"model replicas differ across ranks at start-up (weight checksums range "
                              f"{-int(t[1])}..{int(t[0])}): build the model after the same torch.manual_seed (or "
                              f"--seed) on every rank, from the same code; seed per rank (as 1337 + rank) only "
                              f"after building it, for dropout and data")


def mean_over_group(value, group):
    """Mean of a scalar over the group (for logging the global-batch loss)."""
    t = value.detach().to(torch.promote_types(value.dtype, torch.float32)).reshape(1).clone()   # float64 stays
    all_reduce(t, group=group)
    return float(t) / dist.get_world_size(group)


# ----------------------------------------------------------------------------------------------------------
# the script

def add_args(parser):
    parser.add_argument("--ddp_mode", default="bucket", choices=MODES,
                        help="naive: all-reduce each gradient after backward; overlap: async all-reduce from "
                             "a hook as each gradient is final; bucket: flat buckets of --bucket_mb")


def validate(cfg):
    from common.config import check, grad_accum_steps
    from common.distributed import world_size_from_env
    dp = world_size_from_env()
    check(grad_accum_steps(cfg, dp) > 0, "empty batch")
    check(cfg.bucket_mb > 0, f"--bucket_mb must be positive, got {cfg.bucket_mb}")


def main(argv=None):
    # the script's plumbing, imported here: the building blocks above need only torch and comm.py
    from common import checkpoint
    from common.checkpoint import ModuleState, replicated
    from common.config import fail, grad_accum_steps, parse_config
    from common.distributed import init_distributed, wait_for_main_rank, warn_single_rank
    from common.metrics import MetricsLogger
    from common.optim import NonFiniteGuard, configure_optimizer, lr_at, set_lr
    from common.evaluation import evaluate, print_sample
    from common.model_setup import gpt_config
    from common.precision import autocast_context, enable_tf32, param_dtype, resolve_dtype
    from common.startup import prepare_data
    from converters.apply import apply_kernels_and_fp8
    from model import GPT, flops_per_token
    cfg = parse_config(argv, techniques=("bucket_mb", "fp8"), description=__doc__.split("\n\n")[0],
                       extra_args=add_args, validate=validate)
    env = init_distributed(cfg)
    group, dp = dist.group.WORLD, env.world_size
    grad_acc = grad_accum_steps(cfg, dp)
    warn_single_rank(env, "there is nothing to average; this is train_single.py with extra steps (launch with "
                          "torchrun --nproc_per_node N)")
    loader = prepare_data(cfg, env)
    enable_tf32(env.device)
    dtype = resolve_dtype(cfg, env.device)

    model = GPT(gpt_config(cfg, loader.vocab_size), seed=cfg.seed).to(env.device, param_dtype(dtype))
    apply_kernels_and_fp8(model, cfg, env.device)    # as train_single: fused modules, FP8 GEMMs, same parameters
    optimizer = configure_optimizer(model.named_parameters(), cfg, env.device.type)
    scaler = torch.amp.GradScaler(env.device.type, enabled=dtype == torch.float16)
    guard = NonFiniteGuard(cfg, env.is_main, scaler)
    torch.manual_seed(cfg.seed + env.rank)           # dropout: each rank masks its own sequences
    held = ModuleState([model], optimizer, replicated, scaler=scaler)   # what this rank holds, for checkpoints
    start = checkpoint.start_from(cfg, env, model.cfg, held)   # each rank its own RNG state
    try:                                             # compares the ranks' initial weights once
        grads = DataParallelGrads(model.parameters(), group, cfg.ddp_mode, cfg.bucket_mb)
    except ReplicaMismatch as e:
        fail(str(e))
    train_model = torch.compile(model) if cfg.compile else model
    amp = autocast_context(dtype, env.device)
    last_step = cfg.stop_step or cfg.max_steps
    logger = MetricsLogger(cfg, env, flops_per_token(model.cfg), n_devices=dp, resume=cfg.resume)
    if env.is_main:
        print(f"train_ddp: dp {dp}, mode {cfg.ddp_mode}, {len(grads.buckets)} buckets, grad_acc {grad_acc}, "
              f"{dtype}, {env.device}, steps {start}..{last_step - 1}", flush=True)

    for step in range(start, last_step):
        t0 = time.perf_counter()
        COMM.reset()
        lr = lr_at(step, cfg)
        set_lr(optimizer, lr)
        loss_sum = 0.0
        for micro in range(grad_acc):
            grads.require_sync(micro == grad_acc - 1)      # no_sync on all but the last micro-step
            x, y = loader.micro_batch(step, micro, cfg.micro_batch_size, env.rank, dp)
            with amp:
                _, loss = train_model(x, y)
            scaler.scale(loss / grad_acc).backward()       # bucket hooks fire during this call
            loss_sum += loss.detach()
        grads.finish()                                     # wait for the all-reduces, divide by dp
        comm_bytes, calls = COMM.bytes_sent, COMM.calls["all_reduce"]   # gradient traffic of this step
        scaler.unscale_(optimizer)
        grad_norm = clip_grad_norm(grads.grads(), cfg.grad_clip)   # replicated grads: no group needed
        loss_value = mean_over_group(loss_sum / grad_acc, group)   # logging and the guard, not in comm_bytes
        if guard.step_ok(step, loss_value, grad_norm):             # global values: every rank decides alike
            scaler.step(optimizer)
        scaler.update()
        grads.zero_grad()
        logger.log_step(step, loss_value, lr, float(grad_norm), time.perf_counter() - t0, comm_bytes,
                        comm_calls=calls)

        if cfg.eval_interval > 0 and (step % cfg.eval_interval == 0 or step == cfg.max_steps - 1):
            if env.is_main:                                # replicas agree: rank 0 evaluates for all
                model.eval()
                with amp:
                    val = evaluate(lambda x, y: train_model(x, y)[1], loader, cfg)
                model.train()
                logger.log_eval(step, val)
            wait_for_main_rank(group, cfg, "evaluation")
        if checkpoint.should_save(cfg, step, last_step):              # replicas agree: rank 0 writes, with each
            checkpoint.save(cfg, model.cfg, step + 1, held)   # rank's own dropout stream
    logger.close()
    print_sample(model, loader, cfg, env)
    return dict(model=model, cfg=cfg, grads=grads)


if __name__ == "__main__":
    from common.distributed import destroy
    main()
    destroy()   # leave the group together: a rank exiting early aborts the others' gloo/NCCL threads
