"""
comm.py: every collective nanoscale uses, each one counted, and what the rungs' building blocks need besides: the
gradient norm over a group (one all-reduce), profiler labels, and care for autocast's 16 bits (activations
communicated in the compute dtype; ZeRO-3's casts of gathered weights freed with them). Imports only torch and the
stdlib, so a technique copied out of this project takes this file with it and nothing else (docs/copy_out.md;
common/distributed.py starts the process group).

    all_reduce(grad, group=dp_group) # the same call as torch.distributed, plus bytes accounting
    gather_seq(x, tp_group)          # [B, T/n, h] -> [B, T, h] (reduce_scatter_seq: back, summed)
    COMM.bytes_sent                  # bytes this rank sent since the last COMM.reset()
    comm.LAUNCH_LOG = []             # record every launch in NCCL's groups, for nccl_check.py (default off)
    clip_grad_norm(grads, 1.0, group=tp_group)   # the global grad norm of gradients spread over a group
    with label("pp:F mb0 chunk0"): ...           # a named range in a --profile trace (nothing when off)
    x = in_compute_dtype(x)                      # under autocast: fp32 -> bf16 before x travels to a matmul
    all_gather_as(full, shard, torch.bfloat16)   # bf16 on the wire, widened into the fp32 `full` (ZeRO-3)

Under a torch profiler (--profile, profiling.py) each call is also a range "comm:<op> [group's global ranks]", and
an async call's wait() a range "comm:wait <op> ...": traces show communication (bench/timeline.py colours it).

Bytes are counted under the standard ring algorithms (docs/observability.md), S = the full tensor's bytes,
n = group size, counting what *this rank sends*:
    all_reduce 2(n-1)/n * S     reduce_scatter (n-1)/n * S of its input    all_gather (n-1)/n * S of its output
    all_to_all: the bytes of its input that go to other ranks (= (n-1)/n * S for even splits)
    send S (recv 0)             broadcast (n-1)/n * S (pipelined chain)
So one convention holds everywhere and DP, ZeRO-1/2 and ZeRO-3 come out at 2P, 2P and 3P times (n-1)/n.
"""
import contextlib
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

# torch >= 2.13 renamed the flat-tensor collectives and warns on the old names; older torch only has those.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommCounter:
    """Bytes this rank sent since the last reset(): in total, per operation and per group (train_5d: by axis)."""

    def __init__(self):
        self.paused = False
        self.reset()

    def reset(self):
        self.bytes_sent = 0.0
        self.by_op = defaultdict(float)
        self.calls = defaultdict(int)
        self.by_group = defaultdict(float)      # key: the group passed (None: the default group)

    def add(self, op, nbytes, group=None):
        if self.paused:
            return
        self.bytes_sent += nbytes
        self.by_op[op] += nbytes
        self.calls[op] += 1
        self.by_group[group] += nbytes

    @contextlib.contextmanager
    def uncounted(self):
        """Collectives inside are left out of the counts: the loss reduced for the log and NonFiniteGuard is not."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


COMM = CommCounter()

# Off (None) by default. A list records every launch of this process, in order, as NCCL would run it: one entry per
# group (a batch_isend_irecv, a lone send or recv, a collective), each a list of (kind, peer global rank, nbytes, the
# group's global ranks), kind "send", "recv" or "coll" (peer None), for nccl_check.py's replay under NCCL's rules.
LAUNCH_LOG = None


def _log(ops):
    """Append one group of (kind, peer, tensor, group) to LAUNCH_LOG; free when not recording."""
    if LAUNCH_LOG is not None:
        LAUNCH_LOG.append([(kind, peer, t.nbytes, _ranks(group)) for kind, peer, t, group in ops])


PROFILE_PREFIX = "comm:"


def label(name):
    """A range `name` in the trace while a torch profiler records (pipeline actions, ring steps), else nothing."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


class LabelledWork:
    """An async call's work whose wait() is a profiler range: time spent waiting for communication shows as such."""

    def __init__(self, work, name):
        self.work, self.name = work, name

    def wait(self, *args, **kwargs):
        with torch.profiler.record_function(self.name):
            return self.work.wait(*args, **kwargs)

    def __getattr__(self, attr):                 # is_completed, get_future, ...: the work's own
        return getattr(self.work, attr)


def collective_failed(op, group, error):
    """The error to raise from `error`, a failed `op` on `group` (timed out, or a peer made another call: most often one
    rank ran a forward the others did not, an evaluation on rank 0 alone), its usual cause named; the same class
    (torch's DistError stays one) and first words, the original chained."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    cls = type(error) if isinstance(error, dist.DistError) else RuntimeError
    return cls(f"{op} over ranks {list(_ranks(group))} failed ({first_line}): every rank must run every forward of "
               f"a sharded model (ZeRO-3, TP) in the same order: evaluate and sample on every rank, not rank 0 alone")


def wait_for(work, op, group):
    """work.wait() of an async `op` on `group`, its failure raised as collective_failed's error."""
    try:
        return work.wait()
    except RuntimeError as e:
        raise collective_failed(op, group, e) from e


def _launch(op, group, fn, /, *args, peer=None, **kwargs):
    """fn(*args, **kwargs), the torch.distributed call; labelled (module docstring) only while a torch profiler
    records, so nothing is added when profiling is off. A failing call says its usual cause (collective_failed)."""
    try:
        if not torch.autograd._profiler_enabled():
            return fn(*args, **kwargs)
        name = f"{op} {list(_ranks(group))}" + ("" if peer is None else f" -> {peer}")
        with torch.profiler.record_function(PROFILE_PREFIX + name):
            works = fn(*args, **kwargs)
    except RuntimeError as e:
        raise collective_failed(op, group, e) from e
    if isinstance(works, list):                  # batch_isend_irecv
        return [LabelledWork(w, f"{PROFILE_PREFIX}wait {name}") for w in works]
    return None if works is None else LabelledWork(works, f"{PROFILE_PREFIX}wait {name}")


def _ranks(group):
    """The group's global ranks: the same name for its communicator on every member."""
    return tuple(dist.get_process_group_ranks(dist.group.WORLD if group is None else group))


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    n = dist.get_world_size(group)
    COMM.add("all_reduce", 2 * (n - 1) / n * tensor.nbytes, group)
    _log([("coll", None, tensor, group)])
    return _launch("all_reduce", group, dist.all_reduce, tensor, op=op, group=group, async_op=async_op)


def all_gather(output, input, group=None, async_op=False):
    """Gather equal-sized flat shards into `output` (n * input.numel() elements)."""
    n = dist.get_world_size(group)
    COMM.add("all_gather", (n - 1) / n * output.nbytes, group)
    _log([("coll", None, output, group)])
    return _launch("all_gather", group, _all_gather_flat, output, input, group=group, async_op=async_op)


def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Sum `input` across the group and keep this rank's 1/n slice in `output`."""
    n = dist.get_world_size(group)
    COMM.add("reduce_scatter", (n - 1) / n * input.nbytes, group)
    _log([("coll", None, input, group)])
    return _launch("reduce_scatter", group, _reduce_scatter_flat, output, input, op=op, group=group,
                   async_op=async_op)


# all_gather and reduce_scatter along the sequence (train_tp's SP): SP splits T of [B, T, h] but the flat
# collectives split dim 0, hence the transposes. Each returns (result, work); the result is valid after
# work.wait() (or at once when not async).

def gather_seq(x, group, async_op=False, dim=1):
    """[B, T/n, ...] on each rank -> [B, T, ...] on every rank (or along another dim: vocabulary, shards)."""
    xt = x.transpose(0, dim).contiguous()
    out = xt.new_empty((dist.get_world_size(group) * xt.shape[0],) + xt.shape[1:])
    work = all_gather(out, xt, group=group, async_op=async_op)
    return out.transpose(0, dim), work


def reduce_scatter_seq(x, group, async_op=False):
    """[B, T, ...] partial sums on each rank -> [B, T/n, ...]: the sum over ranks of my chunk of the sequence."""
    xt = x.transpose(0, 1).contiguous()
    out = xt.new_empty((xt.shape[0] // dist.get_world_size(group),) + xt.shape[1:])
    work = reduce_scatter(out, xt, group=group, async_op=async_op)
    return out.transpose(0, 1), work


def all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    """all_to_all_single along dim 0; counts the rows of `input` that leave this rank."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    row_bytes = input.nbytes / max(input.shape[0], 1)
    if input_split_sizes is None:
        sent = (n - 1) / n * input.nbytes
    else:
        sent = (sum(input_split_sizes) - input_split_sizes[rank]) * row_bytes
    COMM.add("all_to_all", sent, group)
    _log([("coll", None, input, group)])
    return _launch("all_to_all", group, dist.all_to_all_single, output, input, output_split_sizes,
                   input_split_sizes, group=group, async_op=async_op)


def broadcast(tensor, src, group=None, async_op=False):
    n = dist.get_world_size(group)
    COMM.add("broadcast", (n - 1) / n * tensor.nbytes, group)
    _log([("coll", None, tensor, group)])
    return _launch("broadcast", group, dist.broadcast, tensor, src=src, group=group, async_op=async_op)


def send(tensor, dst, group=None):
    COMM.add("send", tensor.nbytes, group)
    _log([("send", dst, tensor, group)])
    return _launch("send", group, dist.send, tensor, dst=dst, group=group, peer=dst)


def recv(tensor, src, group=None):
    _log([("recv", src, tensor, group)])
    return _launch("recv", group, dist.recv, tensor, src=src, group=group, peer=src)


def p2p_op(kind, tensor, peer, group=None):
    """A P2POp for batch_isend_irecv: kind is 'send' or 'recv'; peer is a global rank."""
    fn = dist.isend if kind == "send" else dist.irecv
    return dist.P2POp(fn, tensor, peer, group=group)


def batch_isend_irecv(ops):
    """Launch a batch of P2POps at once (sends and receives paired without deadlock); returns the works."""
    for op in ops:
        if op.op is dist.isend:
            COMM.add("send", op.tensor.nbytes, op.group)
    if not ops:
        return []
    _log([("send" if op.op is dist.isend else "recv", op.peer, op.tensor, op.group) for op in ops])
    return _launch("batch_isend_irecv", ops[0].group, dist.batch_isend_irecv, ops,
                   peer=sorted({op.peer for op in ops}))


GROUP_TIMEOUT = dict(s=None)     # --dist_timeout, set by init_distributed for every group created after it


def new_group(ranks, timeout_s=None, backend=None):
    """A subgroup (every rank of the world calls this with the same ranks, in the same order), with --dist_timeout
    unless timeout_s says otherwise: a stuck collective on it raises. backend: None, or "gloo" (a side group)."""
    timeout_s = GROUP_TIMEOUT["s"] if timeout_s is None else timeout_s
    kwargs = {} if timeout_s is None else dict(timeout=timedelta(seconds=timeout_s))
    return dist.new_group(ranks, backend=backend, **kwargs)


def compute_dtype(dtype, device_type):
    """The dtype a matmul computes an fp32 `dtype` in: autocast's 16-bit dtype while autocast is on for the device type
    ("cpu", "cuda"), else `dtype` itself (float64 runs, runs without autocast: unchanged). Read it where autocast is on
    (a forward); a backward runs outside it, so what it sends is decided at the forward."""
    if dtype == torch.float32 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype


def in_compute_dtype(x):
    """x in compute_dtype, for an activation communicated on its way into a matmul that would cast it anyway (a
    LayerNorm's output is fp32 under autocast): 2 bytes a value on the wire instead of 4, and in its backward twin
    (the gradient takes the dtype of what was sent), as Megatron-LM's 16-bit activations; the same values."""
    return x.to(compute_dtype(x.dtype, x.device.type))


class _Widened:
    """An all_gather_as's work: wait() also widens the gathered 16-bit values into the full-precision output."""

    def __init__(self, work, wire, output):
        self.work, self.wire, self.output = work, wire, output

    def wait(self):
        self.work.wait()
        if self.output.untyped_storage().nbytes() == 0:      # (ZeRO-3's `full`: given its memory only now)
            self.output.untyped_storage().resize_(self.output.nbytes)
        self.output.copy_(self.wire)
        self.wire = None


def all_gather_as(output, input, dtype, group=None, async_op=False):
    """all_gather(output, input) with the values travelling in `dtype` (narrower than output's, e.g. bf16 into an fp32
    buffer): each rank sends its shard rounded to `dtype`, and the gathered values are widened into `output` at wait()
    (exact). ZeRO-3 under autocast (FSDP2's param_dtype): half the bytes, and a matmul sees the weight it would have
    cast anyway. dtype == output's: a plain all_gather."""
    if dtype == output.dtype:
        return all_gather(output, input, group=group, async_op=async_op)
    wire = torch.empty_like(output, dtype=dtype)
    work = _Widened(all_gather(wire, input.to(dtype), group=group, async_op=True), wire, output)
    return work if async_op else work.wait()


class CastsFreedWithParams:
    """Autocast's 16-bit casts of `params` (parameters gathered for a module's forward and freed after it, as ZeRO-3
    does) live no longer than the parameters. A matmul saves its weight's cast for backward, and autocast caches it
    until its outermost region exits: kept as they are, every block's cast would stay alive from its forward to its
    backward, the whole model in 16 bits on every rank. register(module) makes the module's forward (1) cast without
    autocast's cache and (2) save such a cast as (parameter, how it was cast), cast again when backward unpacks it, by
    then from the parameters gathered again for backward (a saved-tensors hook). Without autocast there is no cast:
    nothing changes. Under other saved-tensor hooks (a block recomputed in backward, whose saved tensors are dropped
    anyway; offloading) only (1) applies: autograd runs one pair of hooks at a time."""

    def __init__(self, params):
        self.ids, self.device = {id(p) for p in params}, next(iter(params)).device.type
        self.state = None

    def register(self, module):
        module.register_forward_pre_hook(lambda mod, args: self.enter())
        module.register_forward_hook(lambda mod, args, out: self.exit())

    def enter(self):
        if not torch.is_autocast_enabled(self.device):
            return
        hooks = None
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is None:   # no other pair of hooks active
            hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            hooks.__enter__()
        self.state = (torch.is_autocast_cache_enabled(), hooks)
        torch.set_autocast_cache_enabled(False)

    def exit(self):
        if self.state is not None:
            cache, hooks = self.state
            torch.set_autocast_cache_enabled(cache)
            if hooks is not None:
                hooks.__exit__(None, None, None)
            self.state = None

    def pack(self, t):
        """A saved view of a cast of one of the params (its grad_fn a copy of the parameter's leaf) -> how to
        redo it; anything else is saved as it is."""
        base = t if t._base is None else t._base
        fn = base.grad_fn
        if fn is not None and fn.name() == "ToCopyBackward0":
            param = getattr(fn.next_functions[0][0], "variable", None)     # AccumulateGrad of a leaf
            if id(param) in self.ids and param.device == base.device:
                return param, base.dtype, t.size(), t.stride(), t.storage_offset()
        return t

    @staticmethod
    def unpack(saved):
        if isinstance(saved, torch.Tensor):
            return saved
        param, dtype, size, stride, offset = saved
        assert param.untyped_storage().nbytes() > 0, "a saved cast is needed while its parameter is not gathered"
        return param.detach().to(dtype).as_strided(size, stride, offset)


def refuse_empty_state_dict(module, why):
    """module.state_dict() raises ValueError(why) while a parameter of it holds no memory (ZeRO-3's between gathers):
    torch.save would write a checkpoint without weights, whose load fails far from here."""
    def hook(mod, state_dict, prefix, local_metadata):
        if any(p.untyped_storage().nbytes() == 0 for p in mod.parameters()):
            raise ValueError(why)
    module.register_state_dict_post_hook(hook)


def refuse_torch_clip(params, fix):
    """torch.nn.utils.clip_grad_norm_ over any of `params` (gradients spread over a group: ZeRO's shards, TP's slices)
    raises a ValueError naming `fix`, where torch would clip each rank by its own part's norm (ZeRO-2/3: 0, p.grad is
    None). torch has no hook there: its function is wrapped, once; other parameters are clipped as before."""
    for p in params:
        p.clip_with = fix
    torch_clip = torch.nn.utils.clip_grad_norm_
    if hasattr(torch_clip, "unwrapped"):
        return

    def clip_grad_norm_(parameters, *args, **kwargs):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        fixes = sorted({p.clip_with for p in parameters if hasattr(p, "clip_with")})
        if fixes:
            raise ValueError(f"torch.nn.utils.clip_grad_norm_ sees only this rank's part of these gradients: "
                             f"clip with {' or '.join(fixes)}")
        return torch_clip(parameters, *args, **kwargs)
    clip_grad_norm_.unwrapped = torch_clip
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_


@torch.no_grad()
def clip_grad_norm(grads, max_norm, group=None, device=None, dtype=torch.float32, replicas=()):
    """Global L2 norm of `grads` and, if max_norm > 0, scale them in place so it is at most max_norm.

    With `group`, each rank passes only the gradients it owns (a shard, or a parameter held by one rank) and the squared
    norms are summed across the group, so every rank gets the same global norm. A gradient replicated on several ranks
    of the group must be passed by exactly one of them; the others pass it in `replicas`: left out of the norm, scaled
    like the rest (tensor-parallel replicas, a tied weight's copy). `dtype`: the norm's dtype on a rank that owns no
    gradients (it must match the other ranks' for the all-reduce: float64 runs pass it)."""
    grads = [g for g in grads if g is not None]
    if grads:
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        sq = norm.to(torch.promote_types(norm.dtype, torch.float32)).pow(2)   # float64 grads keep float64
    else:                                   # a rank may own no gradients (e.g. an empty shard)
        sq = torch.zeros((), dtype=dtype, device=device)
    if group is not None:
        all_reduce(sq, group=group)
    norm = sq.sqrt()
    scaled = grads + [g for g in replicas if g is not None]
    if max_norm > 0 and scaled:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(scaled, scale.to(scaled[0].dtype))
    return norm
