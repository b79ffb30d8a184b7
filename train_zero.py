"""
train_zero.py: ZeRO stages 1, 2 and 3 (ZeRO-3 = FSDP) written by hand, over train_ddp.py (its gradient buckets
and post-accumulate-grad hooks, with new actions for a ready bucket). Each bucket / unit of parameters is one
flat buffer padded to a multiple of N ranks; rank r owns elements [r*s, (r+1)*s), s = padded/N.

    torchrun --nproc_per_node 2 train_zero.py --zero_stage 1               # sharded AdamW state
    torchrun --nproc_per_node 4 train_zero.py --zero_stage 2               # + sharded gradients
    torchrun --nproc_per_node 2 train_zero.py --zero_stage 3 --dtype bfloat16  # + sharded parameters

Precision (train_single's recipe): the parameters are fp32 and are their own master copy; --dtype bfloat16
runs the forward and backward under bf16 autocast (each matmul casts its weight on the fly; ZeRO-3 gathers the
shards in bf16, FSDP2's param_dtype, widened into the fp32 buffer), and gradients are accumulated and
reduce-scattered in fp32. Bytes per parameter (planner/inputs.model_state_bytes_per_param("fp32")): params 4,
grads 4, AdamW m + v 8 (float32 and bfloat16 alike; float64 doubles each). bf16 saves activation memory, matmul
time and ZeRO-3's gather bytes, not model-state bytes (bf16 parameter copies would need a second, fp32 master).
Model-state bytes per rank (P parameters, padded to P' with P' - P < N * buckets, N ranks):
    stage 0 (DP)  4P + 4P + 8P           stage 2  4P' + (4P' + 8P')/N
    stage 1       4P' + 4P' + 8P'/N      stage 3  (4P' + 4P' + 8P')/N  (+ gathered units in flight)
Communication per step, b = 4 bytes per value (8 in float64), g = grad_acc (docs/observability.md's convention):
    stage 1  reduce-scatter + all-gather          2 (N-1)/N P' b        (= one all-reduce)
    stage 2  a reduce-scatter per micro-step     (g + 1) (N-1)/N P' b   (gradients never stay whole)
    stage 3  all-gather fwd + bwd + reduce-scatter g (N-1)/N P' (2 b16 + b), b16 = b (2 under bf16 autocast;
             b for a block of FP8 GEMMs, about 1 with --fp8_all_gather: converters/fp8_gather.py)
    stages 1-3 also all-reduce one fp32 scalar (the squared gradient norm): + 2 (N-1)/N * 4 bytes.
ZeRO-3 per block:  pre-forward: gather (prefetch next) -> forward -> free -> pre-backward: gather (prefetch
previous) -> backward -> grads land -> reduce-scatter, free. Embedding + final LayerNorm form the root unit.
ZeRO-R's CB and MD are train_ddp's (its docstring): fixed --bucket_mb buffers, and flat buffers made once whose
views are the parameters and gradients; a ZeRO-3 unit is gathered as one contiguous allocation, not one per tensor.
Any model (docs/copy_out.md): shard_model(..., blocks=) and install_zero3_hooks take the blocks (main's: GPT's).
"""
if __name__ == "__main__":      # run as a script: from here on, torch's import included, a Ctrl-C is one line
    from common.errors import report_interrupts
    report_interrupts()
import argparse
import time
from itertools import accumulate

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from common.comm import (COMM, CastsFreedWithParams, all_gather_as, clip_grad_norm, compute_dtype, reduce_scatter,
                         refuse_empty_state_dict, refuse_torch_clip, wait_for)
from train_ddp import (DataParallelGrads, GradBucket, assign_buckets, compare_checksums, mean_over_group,
                       weights_checksum, validate as validate_ddp)


# ----------------------------------------------------------------------------------------------------------
# building blocks: one shard of a flat parameter group, its optimizer, its gradient reduction (with train_ddp.py
# and comm.py they work on any model: docs/copy_out.md)

class Shard:
    """One bucket (stages 0-2) or unit (stage 3) of parameters: a flat buffer `full` whose views are the model's
    parameters, this rank's slice `shard`, and the AdamW moments of that slice. The parameters are fp32 (float64
    in a float64 run), so the shard is its own master copy (`master` is `shard`); 16-bit compute comes from
    autocast. Stage 3 keeps only `shard` at rest: `full` is resized to zero except between gather() and free()."""

    def __init__(self, names, params, stage, group, dtype, device, initial):
        """dtype: the parameters' (fp32, or float64); initial: {name: full value} of these parameters (a built
        model's current values, or model.init_parameter's for one on the meta device)."""
        assert dtype in (torch.float32, torch.float64), f"Shard keeps fp32 (or float64) parameters, got {dtype}"
        self.names, self.stage, self.group = names, stage, group
        n, rank = (1, 0) if stage == 0 else (dist.get_world_size(group), dist.get_rank(group))
        self.offsets = list(accumulate((p.numel() for p in params), initial=0))
        total = self.offsets.pop()
        self.padded = -(-total // n) * n
        self.lo, self.hi = rank * (self.padded // n), (rank + 1) * (self.padded // n)
        self.master_dtype = dtype
        compare_checksums(weights_checksum(initial.values()), group, device)   # not a per-rank seed's: once
        self.full = self.flatten(initial).to(device)    # the full initial values of this bucket / unit only
        self.params = [torch.nn.Parameter(self.full[off: off + p.numel()].view(p.shape))
                       for p, off in zip(params, self.offsets)]
        for new, old in zip(self.params, params):
            new.__dict__.update(old.__dict__)           # tags other rungs put on parameters (tensor-parallel)
        self.shard = self.full[self.lo: self.hi].clone() if stage == 3 else self.full[self.lo: self.hi]
        self.master = self.shard                        # the optimizer steps the parameters' own slice
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.shard), torch.zeros_like(self.shard)
        # AdamW decays >= 2-D parameters only (as optim.configure_optimizer): their runs inside the shard
        self.decay_runs = [(max(off, self.lo) - self.lo, min(off + p.numel(), self.hi) - self.lo)
                           for p, off in zip(params, self.offsets)
                           if p.dim() >= 2 and off < self.hi and off + p.numel() > self.lo]
        self.handle, self.in_backward, self.wire_dtype = None, False, None
        self.all_gather = all_gather_as                 # how gather() fills `full` (a wrapper may gather otherwise)
        if stage == 3:
            self.full.untyped_storage().resize_(0)      # at rest: only the shard

    def flatten(self, values):
        """Whole tensors (by parameter name) laid out as this shard's zero-padded flat buffer, in the master's
        dtype: ZeRO's flat layout, also how a checkpoint's whole tensors become this rank's slice on load."""
        full = torch.zeros(self.padded, dtype=self.master_dtype)
        for name, off in zip(self.names, self.offsets):
            value = values[name].reshape(-1)
            full[off: off + value.numel()] = value
        return full

    def gather(self, dtype=None):
        """Stage 3: start the all-gather of the full parameters (async) in `dtype` (theirs; bf16 under autocast, widened
        into `full` at wait(), which allocates it: a prefetched unit holds 2 bytes a value, not 6); wait() to use."""
        if self.handle is None and self.full.untyped_storage().nbytes() == 0:
            if (dtype or self.master_dtype) == self.master_dtype:
                self.full.untyped_storage().resize_(self.padded * self.full.element_size())
            # into `.data` (same memory, own version counter): refilling saved parameters is no modification
            self.handle = self.all_gather(self.full.data, self.shard, dtype or self.master_dtype, self.group, True)

    def wait(self):
        self.gather()
        if self.handle is not None:
            wait_for(self.handle, "ZeRO-3's all_gather", self.group)    # a rank left out of a forward: says so
            self.handle = None

    def free(self):
        self.full.untyped_storage().resize_(0)          # parameter views keep their shape, lose their memory
        self.in_backward = False

    @torch.no_grad()
    def publish(self):
        """After the optimizer step (stages 1-2): all-gather the updated shards so every rank's full parameters
        agree again. Stage 0 stepped the full buffer itself; stage 3 gathers before each use."""
        if self.stage in (1, 2):
            all_gather_as(self.full, self.shard, self.master_dtype, self.group)


class ShardedAdamW:
    """AdamW on the flat fp32 (float64) shards (elementwise, so a shard is stepped exactly like the full tensor)
    with the one-pass kernel behind torch.optim.AdamW(fused=True). Weight decay applies to >= 2-D parameters
    only (matmul weights, embeddings; not biases or norms), as optim.configure_optimizer's groups; betas and eps
    default to optim.py's."""

    def __init__(self, shards, weight_decay, betas=(0.9, 0.95), eps=1e-8):
        (self.beta1, self.beta2), self.eps, self.wd = betas, eps, weight_decay
        self.shards, self.steps = shards, 0
        self.step_on_device = torch.zeros((), device=shards[0].master.device)    # the kernel reads the step there

    @torch.no_grad()
    def step(self, lr, grads):
        self.steps += 1
        masters = [s.master for s in self.shards]
        m, v = [s.exp_avg for s in self.shards], [s.exp_avg_sq for s in self.shards]
        for s in self.shards:        # decoupled decay, only on the runs of >= 2-D parameters inside the shard
            for a, b in s.decay_runs:
                s.master[a:b].mul_(1 - lr * self.wd)
        steps = [self.step_on_device.fill_(self.steps)] * len(masters)   # filled from a scalar: no copy; read only
        torch._fused_adamw_(masters, grads, m, v, [], steps, lr=lr, beta1=self.beta1, beta2=self.beta2,
                            weight_decay=0.0, eps=self.eps, amsgrad=False, maximize=False)


class ReducedTwice(RuntimeError):
    """A ZeRO-1 bucket (reduced in place) asked to reduce again before zero_grad(): its earlier micro-batches twice."""


class ShardBucket(GradBucket):
    """train_ddp's bucket over a Shard's parameters, its buffer padded as the Shard's (N equal slices to
    reduce-scatter). ShardedGrads sets `shard` and `reduced` (stage 1 reduced it in place this step)."""

    def allocate(self):
        if self.buffer is None:
            self.buffer = self.shard.full.new_zeros(self.shard.padded)    # the parameters' dtype and device


class ShardedGrads(DataParallelGrads):
    """train_ddp's buckets and hooks with ZeRO's action for a ready bucket: reduce-scatter it into this rank's
    gradient shard. Stage 1 keeps DDP's bucket buffers (no_sync accumulation) and reduces once a step, in place
    (require_sync(last micro-batch); twice raises ReducedTwice). Stage 2 copies each final gradient into a bucket
    buffer, stage 3 attaches param.grad to one; either lives until its reduce-scatter, summed into the shard."""

    def __init__(self, shards, group, stage):
        self.shards, self.stage = shards, stage         # for make_buckets: one bucket per shard
        super().__init__([p for s in shards for p in s.params], group, "bucket")
        self.communicate, self.in_flight = True, []
        if stage >= 1:                                  # torch's would see unreduced slices (1) or no gradient (2-3)
            refuse_torch_clip(self.params, "comm.clip_grad_norm(grads.grads(), max_norm, group=group)")

    def make_buckets(self, bucket_mb):
        """A bucket per shard, in the shards' order; each shard's gradient (stages 0-1: a slice of the bucket)."""
        buckets = [ShardBucket(s.params) for s in self.shards]
        for b, s in zip(buckets, self.shards):
            b.shard, b.reduced = s, False
            if self.stage <= 1:
                b.attach_grads()                        # DDP's persistent buffer
            s.grad = b.buffer[s.lo: s.hi] if self.stage <= 1 else torch.zeros_like(s.shard)
        return buckets

    def prepare(self, shard):
        """Stage 3, as a unit's backward starts: a fresh buffer whose views are its param.grad (no copy)."""
        self.bucket_of[id(shard.params[0])][0].attach_grads()

    def grad_landed(self, bucket, i, p):
        if self.stage <= 1:
            super().grad_landed(bucket, i, p)           # DDP's buffers: the gradient sits in them
        elif self.stage == 2:
            bucket.allocate()                           # on the bucket's first gradient
            bucket.view(i).copy_(p.grad)
            p.grad = None                               # the full-size gradient is freed at once

    def launch(self, bucket):
        if self.stage == 0:
            return super().launch(bucket)
        s = bucket.shard
        if self.stage == 1 and bucket.reduced:          # its other slices still hold the earlier micro-batches
            raise ReducedTwice("ZeRO-1 reduces once a step: require_sync(micro == last), not (True) as stages 2-3")
        bucket.reduced = True
        if self.stage == 3:
            s.free()                                    # this unit's backward is over
            for p in bucket.params:
                p.grad = None                           # the buffer lives until its reduce-scatter is done
        bucket.allocate()                               # in case no parameter of it got a gradient
        bucket.out = s.grad if self.stage == 1 else torch.empty_like(s.grad)
        bucket.work = reduce_scatter(bucket.out, bucket.buffer, group=self.group, async_op=True)
        if self.stage >= 2:                             # keep at most two buffers in flight
            self.in_flight.append(bucket)
            if len(self.in_flight) > 2:
                self.complete(self.in_flight.pop(0))

    def complete(self, bucket):
        if self.stage == 0 or bucket.work is None:
            return super().complete(bucket)
        bucket.work.wait()
        bucket.work = None
        bucket.out.div_(self.n)                         # stage 1: this is the shard's gradient itself
        if self.stage >= 2:
            bucket.shard.grad.add_(bucket.out)
            bucket.buffer = None                       # the non-owned part of the gradients is gone
        bucket.out = None

    def grads(self):
        return [b.shard.grad for b in self.buckets]

    def zero_grad(self):
        for b in self.buckets:
            (b.buffer if self.stage <= 1 else b.shard.grad).zero_()
            b.reduced = False


def shard_model(model, stage, group, dtype, device, blocks=None, buckets=None, bucket_mb=25.0, names=None,
                initial_value=None):
    """Swap the model's parameters for views of flat Shards, in place; returns the shards (launch order).

    Stage 3 shards one unit per module of `blocks` (the modules gathered one at a time, in forward order: a
    transformer's blocks) and root units of every other parameter (embeddings, final norm, head): one, or the
    groups `buckets` gives (a pipeline stage's tied embedding alone, so that its two copies' shards line up), or
    none where there is no other parameter (a middle pipeline stage). Stages 0-2 shard `buckets` (parameter
    groups in the order their gradients come; default assign_buckets over bucket_mb MiB, last parameters first).
    names: {parameter: name} (default model.named_parameters()'s). initial_value(name, p): the full initial value
    of p (default its current value; a model built on the meta device needs one, e.g. model.init_parameter)."""
    named = names or {p: n for n, p in model.named_parameters()}
    if stage == 3:   # units: blocks in backward order, then the roots
        assert blocks is not None, "ZeRO-3 needs the blocks: the modules whose parameters are gathered together"
        units = [list(b.parameters()) for b in blocks]
        root = [p for p in model.parameters() if all(p is not q for unit in units for q in unit)]
        groups = list(reversed(units)) + (buckets if buckets is not None else [root] if root else [])
    else:
        groups = buckets or assign_buckets(list(reversed(list(model.parameters()))), bucket_mb * 2 ** 20)
    shards = []
    for params in groups:
        initial = {named[p]: p.detach() if initial_value is None else initial_value(named[p], p) for p in params}
        s = Shard([named[p] for p in params], params, stage, group, dtype, device, initial)
        new = {id(old): p for old, p in zip(params, s.params)}
        for module in model.modules():                 # every attribute holding one (tied weights: two)
            for key, p in module._parameters.items():
                module._parameters[key] = new.get(id(p), p)
        shards.append(s)
    return shards


def install_zero3_hooks(model, blocks, shards, grads, prefetch=True, reshard_after_forward=True):
    """Gather a block's parameters just before its forward and its backward, free them right after; with
    prefetch, start the all-gather of the block that runs next while this one computes. `blocks` and `shards`:
    as given to and returned by shard_model. The root units are gathered around the model's forward and from the
    first gradient reaching any of its outputs (whatever they are: logits, a loss, a tuple) until backward ends.
    reshard_after_forward=False (FSDP2's name) keeps a unit gathered from its forward until its backward is
    over: one all-gather fewer per use, the whole unit held in between. grads: ShardedGrads, its prepare(unit)
    called as a unit's backward starts."""
    units, roots = list(reversed(shards[:len(blocks)])), shards[len(blocks):]    # blocks' units in forward order

    def fetch(unit, forward=False):  # in autocast's dtype, read in a forward: a backward runs outside autocast
        unit.wire_dtype = compute_dtype(unit.master_dtype, unit.shard.device.type) if forward else unit.wire_dtype
        unit.gather(unit.wire_dtype)

    def release(unit):               # after a forward; kept for its backward when not resharding (training only)
        if reshard_after_forward or not torch.is_grad_enabled():
            unit.free()

    def pre_backward(i):
        def hook(grad):
            mine = roots if i is None else [units[i]]
            if any(unit.in_backward for unit in mine):   # the roots hook every output: the first one acts
                return
            for unit in mine:
                unit.in_backward = True
                fetch(unit)
            for unit in mine:
                unit.wait()
                grads.prepare(unit)
            nxt = len(units) - 1 if i is None else i - 1
            if prefetch and nxt >= 0:
                fetch(units[nxt])
        return hook

    def pre_forward(i):
        def hook(module, args):
            if units[i].in_backward:                   # a recompute (--recompute full) inside backward
                return
            fetch(units[i], forward=True)
            units[i].wait()
            if prefetch and i + 1 < len(units):
                fetch(units[i + 1], forward=True)
        return hook

    def post_forward(i):
        def hook(module, args, out):
            if units[i].in_backward:
                return
            release(units[i])
            first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if first is not None:
                first.register_hook(pre_backward(i))
        return hook

    def root_pre_forward(module, args):
        for unit in roots:
            fetch(unit, forward=True)
        for unit in roots:
            unit.wait()

    def root_post_forward(module, args, out):
        for unit in roots:
            release(unit)
        for t in tree_leaves(out):                     # tensors inside tuples, lists and dicts too
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(pre_backward(None))

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(pre_forward(i))
        block.register_forward_hook(post_forward(i))
        CastsFreedWithParams(units[i].params).register(block)     # autocast: 16-bit casts freed with the unit
    model.register_forward_pre_hook(root_pre_forward)
    model.register_forward_hook(root_post_forward)
    refuse_empty_state_dict(model, "ZeRO-3 holds no whole weights between forwards: gather (every shard's wait())")


# ----------------------------------------------------------------------------------------------------------
# the script

def add_args(parser):
    parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                        help="ZeRO-3: start the next block's all-gather while the current block computes")


def validate(cfg):
    from common.config import check
    from converters.apply import check_fp8_all_gather
    validate_ddp(cfg)                                   # the batch over the ranks and --bucket_mb, as DDP's
    check(cfg.dtype in ("auto", "float32", "bfloat16", "float64"),
          f"train_zero.py supports --dtype float32, bfloat16 (autocast over fp32 parameters) or float64, got "
          f"{cfg.dtype} (fp16 needs a GradScaler whose overflow check spans the gradient shards)")
    check_fp8_all_gather(cfg)


def main(argv=None):
    # the script's plumbing, imported here: the building blocks above need only torch, comm.py and train_ddp.py
    from common.config import grad_accum_steps, parse_config
    from common.distributed import init_distributed, warn_single_rank
    from common.metrics import GatheredBytes, MetricsLogger, model_state_bytes
    from common.optim import BETAS, EPS, NonFiniteGuard, lr_at
    from common.evaluation import evaluate, print_sample
    from common.model_setup import gpt_config
    from common.precision import autocast_context, enable_tf32, param_dtype, resolve_dtype
    from common.startup import prepare_data
    from converters.apply import apply_kernels_and_fp8, compiled
    from common import checkpoint
    from model import GPT, flops_per_token, init_parameter
    cfg = parse_config(argv, techniques=("zero_stage", "bucket_mb", "fp8", "fp8_all_gather"), extra_args=add_args,
                       description=__doc__.split("\n\n")[0], validate=validate)
    env = init_distributed(cfg)
    group, dp, stage = dist.group.WORLD, env.world_size, cfg.zero_stage
    grad_acc = grad_accum_steps(cfg, dp)
    warn_single_rank(env, f"ZeRO-{stage} has nothing to shard (torchrun --nproc_per_node N)")
    loader = prepare_data(cfg, env)
    enable_tf32(env.device)
    dtype = resolve_dtype(cfg, env.device)                # compute: bf16 autocast, or fp32 / float64 throughout

    with torch.device("meta"):                          # shapes only: each Shard builds its own values
        model = GPT(gpt_config(cfg, loader.vocab_size), seed=cfg.seed)
    # ZeRO-3's units: GPT's blocks; every Shard filled from init_parameter (train_single's values, by name)
    shards = shard_model(model, stage, group, param_dtype(dtype), env.device, blocks=list(model.transformer.h),
                         bucket_mb=cfg.bucket_mb,
                         initial_value=lambda name, p: init_parameter(name, p.shape, cfg.n_layer, cfg.seed))
    apply_kernels_and_fp8(model, cfg, env.device, units=shards if stage == 3 else None)   # the same parameters
    grads, gathered = ShardedGrads(shards, group, stage), GatheredBytes(shards)
    if stage == 3:
        install_zero3_hooks(model, list(model.transformer.h), shards, grads, cfg.prefetch)
    optimizer = ShardedAdamW(shards, cfg.weight_decay, BETAS, EPS)
    guard = NonFiniteGuard(cfg, env.is_main)
    torch.manual_seed(cfg.seed + env.rank)              # dropout: each rank masks its own sequences
    held = checkpoint.ShardState(shards, optimizer, [model], checkpoint.replicated)   # what this rank holds
    start = checkpoint.start_from(cfg, env, model.cfg, held)   # each rank its own RNG
    train_model = compiled(model, cfg, list(model.transformer.h) if stage == 3 else ())   # ZeRO-3: by block
    amp = autocast_context(dtype, env.device)
    last_step = cfg.stop_step or cfg.max_steps
    logger = MetricsLogger(cfg, env, flops_per_token(model.cfg), n_devices=dp, resume=cfg.resume)
    padded = sum(s.padded for s in shards)
    if env.is_main:
        print(f"train_zero: ZeRO-{stage}, dp {dp}, {len(shards)} {'units' if stage == 3 else 'buckets'}, {padded:,} "
              f"padded parameters, {dtype}, grad_acc {grad_acc}, steps {start}..{last_step - 1}", flush=True)

    for step in range(start, last_step):
        t0 = time.perf_counter()
        COMM.reset()
        lr = lr_at(step, cfg)
        loss_sum = 0.0
        for micro in range(grad_acc):
            grads.require_sync(stage >= 2 or micro == grad_acc - 1)   # stages 2-3 never keep full grads
            x, y = loader.micro_batch(step, micro, cfg.micro_batch_size, env.rank, dp)
            with amp:
                _, loss = train_model(x, y)
            (loss / grad_acc).backward()                # fp32 gradients: accumulated and reduced in fp32
            grads.finish()
            loss_sum += loss.detach()
        state_bytes = model_state_bytes(model, shards, grads.buckets)   # params + grads + optimizer, alive
        g = grads.grads()                                               # fp32 (float64), like the shards
        grad_norm = clip_grad_norm(g, cfg.grad_clip, group=group if stage > 0 else None, device=env.device,
                                   dtype=shards[0].master_dtype)
        with COMM.uncounted():                                          # for the log and the guard only
            loss_value = mean_over_group(loss_sum / grad_acc, group)
        if guard.step_ok(step, loss_value, grad_norm):                  # global values: every rank decides alike
            optimizer.step(lr, g)
            for s in shards:
                s.publish()
        grads.zero_grad()
        logger.log_step(step, loss_value, lr, float(grad_norm), time.perf_counter() - t0, COMM.bytes_sent,
                        padded_params=padded, gathered_peak_bytes=gathered.peak,
                        **{f"state_bytes_{k}": v for k, v in state_bytes.items()})

        if cfg.eval_interval > 0 and (step % cfg.eval_interval == 0 or step == cfg.max_steps - 1):
            model.eval()                                # every rank: ZeRO-3's forward gathers collectively
            with amp:
                val = evaluate(lambda x, y: train_model(x, y)[1], loader, cfg)
            model.train()
            logger.log_eval(step, val)
        if checkpoint.should_save(cfg, step, last_step):
            checkpoint.save(cfg, model.cfg, step + 1, held)   # each bucket gathered, written by one rank
    logger.close()
    print_sample(model, loader, cfg, env, collective=stage == 3)
    return dict(model=model, cfg=cfg, shards=shards, grads=grads, optimizer=optimizer)


if __name__ == "__main__":
    from common.distributed import destroy
    main()
    destroy()   # leave the group together: a rank exiting early aborts the others' gloo/NCCL threads
