"""
converters/fp8_gather.py: ZeRO-3's all-gather of a unit (train_zero.py's Shard) whose block runs FP8 GEMMs
(kernels/fp8.py's Float8Linear, converters/fp8_tp.py's tensor-parallel layers).

    attach_fp8_gathers(model, units, fp8_all_gather=False)     # after shard_model and apply_kernels_and_fp8

Without --fp8_all_gather the unit travels in its parameters' dtype (fp32), not autocast's bf16 as other units do:
an FP8 GEMM quantizes W from its master values, as one device does, and a bf16 copy on the way would round W
(and its amax, hence every scale) first. With --fp8_all_gather each Float8Linear weight travels already
quantized, 1 byte a value, and the GEMM takes it as is (the unit's norms and biases still travel in fp32):

    each rank   amaxes of its piece of every FP8 weight  --all_reduce MAX-->  the whole weight's (exact: a max)
                scale  s = fp8_max / amax                (delayed: the history's max, as the forward would take it;
                                                          blockwise: one per 128 x 128 block)
                q = clamp(piece * s) -> e4m3              (the same value per element as quantizing W whole)
    all_gather  [q pieces | fp32 norms, biases] packed per rank, padded to the largest rank's bytes
    forward     q and q^T (a byte transpose, its scales transposed) into the FP8 GEMM; delayed pushes the amax

A rank's pieces are the runs of its flat shard [r s, (r+1) s) that each parameter covers, so every rank knows
every rank's packing. Bytes sent per gather of a unit, N ranks, packed(r) = FP8 values + 4 x other values of rank
r's shard (8 in float64):  (N-1) max_r packed(r)  +  the amax all-reduce 2 (N-1)/N x 4 x (amaxes: one per FP8
weight, blockwise one per block). Recipes: tensorwise, delayed and blockwise (whose 128 x 128 blocks quantize W and
W^T alike). Rowwise scales W per row for the forward GEMM and per column for dgrad, two encodings (2 bytes a value,
bf16's): refused (converters/apply.py); so is blockwise on a GPU with native block scales where a weight is not
whole 128-blocks (its GEMM pads W to them).
"""
import torch
import torch.distributed as dist

from common.comm import all_gather, all_gather_as, all_reduce
import kernels.fp8 as fp8
from kernels.fp8 import E4M3, Float8Linear
from kernels.fp8_cast import GRANULARITY, GROUPS, Fp8Cast, _inv_layout, delayed_source
from kernels.fp8_gemm import BLOCK
from converters.fp8_tp import Float8ParallelGemms
from kernels.fp8_quant import amax, quantize, scale_of

GATHERED_RECIPES = ("tensorwise", "delayed", "blockwise")


def fp8_weights(module):
    """{id(weight): module} of the weights whose GEMMs run in FP8 in `module` (Float8Linear, or a tensor-parallel
    layer with FP8 gemms)."""
    out = {}
    for m in module.modules():
        if isinstance(m, Float8Linear) or isinstance(getattr(m, "gemm", None), Float8ParallelGemms):
            out[id(m.weight)] = m
    return out


def attach_fp8_gathers(model, units, fp8_all_gather=False):
    """Make every ZeRO-3 unit holding an FP8 GEMM's weight gather as below (its all_gather), in place; returns the
    gathers."""
    weights = fp8_weights(model)
    out = []
    for unit in units:
        mine = [(i, weights[id(p)]) for i, p in enumerate(unit.params) if id(p) in weights]
        if mine:
            out.append(Float8UnitGather(unit, mine, fp8_all_gather))
            unit.all_gather = out[-1].gather
    return out


def with_memory(full):
    """`full`, a unit's flat buffer, its storage given memory if it has none (ZeRO-3's at rest)."""
    if full.untyped_storage().nbytes() == 0:
        full.untyped_storage().resize_(full.nbytes)
    return full


class Float8UnitGather:
    """How one unit is gathered: whole in its parameters' dtype, or (quantized) its Float8Linear weights in FP8."""

    def __init__(self, unit, fp8_params, quantized):
        self.unit, self.quantized = unit, quantized
        self.modules = {i: m for i, m in fp8_params}
        if quantized:
            recipes = {getattr(m, "recipe", "tensor-parallel") for m in self.modules.values()}
            if recipes - set(GATHERED_RECIPES):
                raise ValueError(f"--fp8_all_gather gathers the Float8Linear weights of the {GATHERED_RECIPES} "
                                 f"recipes; this unit has {sorted(recipes)} FP8 layers")
            if "blockwise" in recipes and any(fp8.gemm_kind(unit.params[i]) == "cuda_blocks" and
                                              (unit.params[i].shape[0] % BLOCK or unit.params[i].shape[1] % BLOCK)
                                              for i in self.modules):
                raise ValueError(f"--fp8_all_gather with blockwise on a GPU with native block scales needs weights "
                                 f"of whole {BLOCK}-blocks (n_embd a multiple of {BLOCK}): its GEMM pads them")
            n = dist.get_world_size(unit.group)
            self.runs = [self.runs_of(r * (unit.padded // n), (r + 1) * (unit.padded // n)) for r in range(n)]
            self.width = max(sum(self.run_bytes(run) for run in runs) for runs in self.runs)

    def runs_of(self, lo, hi):
        """(parameter index, start, end) in flat unit coordinates of each parameter's part of [lo, hi)."""
        out = []
        for i, (p, off) in enumerate(zip(self.unit.params, self.unit.offsets)):
            a, b = max(off, lo), min(off + p.numel(), hi)
            if a < b:
                out.append((i, a, b))
        return out

    def run_bytes(self, run):
        i, a, b = run
        return (b - a) * (1 if i in self.modules else self.unit.master_dtype.itemsize)

    def gather(self, full, shard, dtype, group, async_op=True):
        """Start the unit's all-gather into `full` (its parameters' dtype; `dtype`, autocast's, is not used), given
        memory first: Shard.gather leaves it without for a gather in 16 bits, which is widened into it at wait()."""
        if not self.quantized:
            return all_gather_as(with_memory(full), shard, self.unit.master_dtype, group, async_op)
        return _PackedGather(self, full, shard, group)


class _PackedGather:
    """One FP8 all-gather of a unit in flight: quantize and pack this rank's shard, send; wait() unpacks."""

    def __init__(self, plan, full, shard, group):
        unit, self.plan, self.full = plan.unit, plan, full
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        self.currents, self.sources = self.amaxes(shard, plan.runs[rank], group)
        parts = []
        for i, a, b in plan.runs[rank]:
            piece = shard[a - unit.lo: b - unit.lo]
            if i in plan.modules:
                region, row, at = self.region(i, piece, a - unit.offsets[i])
                q = quantize(region, E4M3, self.granularity(i), self.sources[i][row // BLOCK:])[0]
                piece = q.reshape(-1)[at: at + piece.numel()]
            parts.append(piece.reshape(-1).view(torch.uint8))
        send = torch.zeros(plan.width, dtype=torch.uint8, device=shard.device)
        if parts:
            packed = torch.cat(parts)
            send[:packed.numel()] = packed
        self.received = torch.empty(n * plan.width, dtype=torch.uint8, device=shard.device)
        self.work = all_gather(self.received, send, group=group, async_op=True)

    def granularity(self, i):
        """quantize()'s name for weight i's scale groups: 'tensor', or 'block' (128 x 128)."""
        return GRANULARITY[GROUPS[self.plan.modules[i].recipe]["weight"][0]]

    def amax_shape(self, i):
        N, K = self.plan.unit.params[i].shape
        return (-(-N // BLOCK), -(-K // BLOCK)) if self.granularity(i) == "block" else (1, 1)

    def region(self, i, piece, start):
        """(values, first row, offset of the piece in them) that quantize weight i's piece (its flat values from
        `start`) with its scale groups: the piece itself for one scale; for 128 x 128 blocks the whole block rows
        it touches, zero elsewhere (zeros raise no amax)."""
        if self.granularity(i) == "tensor":
            return piece.view(1, -1), 0, 0
        N, K = self.plan.unit.params[i].shape
        row = start // K // BLOCK * BLOCK
        end = min(N, -(-(start + piece.numel()) // K // BLOCK) * BLOCK)
        region = piece.new_zeros(end - row, K)
        region.view(-1)[start - row * K: start - row * K + piece.numel()] = piece
        return region, row, start - row * K

    def amaxes(self, shard, runs, group):
        """Each FP8 weight's whole amaxes (one, or one per 128 x 128 block: its pieces' maxed over the group) and
        the scale source it quantizes with: those, or under delayed scaling the history's max (without pushing:
        the forward pushes)."""
        unit, modules = self.plan.unit, self.plan.modules
        local = {i: shard.new_zeros(self.amax_shape(i), dtype=torch.float32) for i in modules}
        for i, a, b in runs:
            if i in modules:
                region, row, _ = self.region(i, shard[a - unit.lo: b - unit.lo], a - unit.offsets[i])
                part = amax(region, self.granularity(i)).reshape(-1, local[i].shape[1])
                local[i][row // BLOCK:][:part.shape[0]] = part
        flat = torch.cat([local[i].reshape(-1) for i in modules])
        all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        currents = dict(zip(modules, (v.view(local[i].shape) for i, v in
                                      zip(modules, flat.split([local[i].numel() for i in modules])))))
        sources = {i: delayed_source(m.amax_history[1].clone(), currents[i]) if m.recipe == "delayed" else currents[i]
                   for i, m in modules.items()}
        return currents, sources

    def wait(self):
        """Unpack: the norms and biases into `full`; each FP8 weight's q [N, K] and q^T [K, N] into the first 2
        bytes a value of its own place in `full` (4 or 8 bytes a value, whose fp32 W nothing reads), so they are
        freed with the unit (the forward keeps its own copy of q^T for dgrad)."""
        self.work.wait()
        with_memory(self.full)                       # (Shard.gather left it without: this gather is not in fp32)
        plan, unit = self.plan, self.plan.unit
        raw, size = self.full.view(torch.uint8), unit.master_dtype.itemsize
        q = {i: raw[unit.offsets[i] * size:][:unit.params[i].numel()] for i in plan.modules}
        for r, runs in enumerate(plan.runs):
            at = r * plan.width
            for run in runs:
                i, a, b = run
                data = self.received[at: at + plan.run_bytes(run)]
                if i in plan.modules:
                    q[i][a - unit.offsets[i]: b - unit.offsets[i]] = data
                else:
                    self.full[a: b] = data.view(unit.master_dtype)
                at += plan.run_bytes(run)
        for i, m in plan.modules.items():
            (N, K), n = unit.params[i].shape, unit.params[i].numel()
            w = q[i].view(N, K)
            wt = raw[unit.offsets[i] * size + n:][:n].view(K, N)
            wt.copy_(w.t())
            # 1/scales as the cast lays them out (W's, and W^T's: the same groups transposed), from the amaxes the
            # shards were quantized with
            groups = GROUPS[m.recipe]["weight"][0]
            scale = scale_of(self.sources[i], E4M3)
            inv, inv_t = _inv_layout(scale.reciprocal(), groups, N), _inv_layout(scale.t().reciprocal(), groups, K)
            m.gathered_weight = (Fp8Cast(w.view(E4M3), inv, wt.view(E4M3), inv_t), self.currents[i])
        self.received = None
