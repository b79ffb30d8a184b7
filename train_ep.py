"""
train_ep.py: expert parallelism, over train_single.py's mixture-of-experts model. The E experts of every MoE
block are split over the ep ranks of an expert-parallel group (E/ep each); everything else (attention, router,
embeddings, LayerNorms) is replicated and gradient-averaged exactly like data parallelism (train_ddp.py).
Each rank routes its own tokens and ships every token to the rank that owns its expert and back:

    torchrun --nproc_per_node 2 train_ep.py --ep 2 --n_experts 8 --top_k 2
    torchrun --nproc_per_node 4 train_ep.py --ep 2 --n_experts 4 --top_k 1 --moe_every 2   # 2 EP groups
    torchrun --nproc_per_node 2 train_ep.py --ep 2 --n_experts 4 --capacity_factor 1.25    # drop overflow

One MoE block on rank r (ep=2, E=4: rank 0 owns experts 0-1, rank 1 owns experts 2-3):

    tokens -> router -> top-k -> sort the (token, expert) rows by expert: [ e0 e0 e1 | e2 e2 e2 e3 ]
                                                                         to rank 0 | to rank 1
    all_gather the row counts [ep, E]: every rank now knows every split of the exchange
    all_to_all_single (variable splits)   -> rows from every rank for my experts, grouped by source
    regroup by local expert, run each expert MLP, restore the arrival order
    all_to_all_single (splits swapped)    -> my rows come back, in the order I sent them
    y[token] += gate * expert_out          (model.combine, the same code as the single-device MoE)
Backward runs the two exchanges again with the splits swapped, so gradients reach the router and the input.

Dropless by default (every routed row is computed), which is why this reproduces train_single.py exactly.
Bytes this rank sends per MoE block per micro-batch (docs/observability.md: only rows leaving the rank count):
    all_to_all = 2 * (S + R) * h * bytes     S rows sent to other ranks, R rows received from them
(dispatch S + combine R forward, and the same amounts backward), plus the all_gather of the counts.
Parameters per rank: P_dense + n_moe_blocks * (E/ep) * (8h^2 + 5h): the expert weights shrink by ep.
Any MoE whose experts are one module called on all routed rows (model.Experts; docs/copy_out.md) takes
ExpertParallelExperts in their place; experts stored as one [E, ...] tensor per weight and called on each token's
top-k (Hugging Face's MoE models) take ExpertParallelStackedExperts.
"""
if __name__ == "__main__":      # run as a script: from here on, torch's import included, a Ctrl-C is one line
    from common.errors import report_interrupts
    report_interrupts()
import functools
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from common.comm import COMM, all_gather, all_reduce, all_to_all, clip_grad_norm, in_compute_dtype, new_group
from train_ddp import DataParallelGrads, mean_over_group


# ----------------------------------------------------------------------------------------------------------
# building blocks (train_5d.py imports these; with train_ddp.py and comm.py they work on any MoE whose experts
# are one module called on all routed rows: docs/copy_out.md)

class AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with variable splits; its gradient is the same exchange with the splits
    swapped (what I sent to rank j comes back from rank j)."""

    @staticmethod
    def forward(ctx, rows, recv_splits, send_splits, group):
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        out = rows.new_empty(sum(recv_splits), rows.shape[1])
        all_to_all(out, rows.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        out = grad.new_empty(sum(send_splits), grad.shape[1])
        all_to_all(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


def gather_counts(counts, group):
    """[ep, E] table: entry (s, e) = rows rank s sends to expert e. One small all_gather instead of a
    second all_to_all, so the all_to_all bytes are exactly the routed rows."""
    n = dist.get_world_size(group)
    table = counts.new_empty(n * counts.numel())
    all_gather(table, counts.contiguous(), group=group)
    return table.view(n, -1)


class ExpertParallelExperts(nn.ModuleDict):
    """Drop-in for an MoE's experts module (model.Experts): forward(rows, expert) runs rows [A, h], grouped by
    expert, each on the expert `expert` [A] names, and returns their outputs in the same order; but this rank
    holds only experts [r*E/ep, (r+1)*E/ep) of the E, and the rows travel to the rank owning their expert and
    back. make_expert(e) builds (or hands over) expert e; keyed by its global index, each keeps the name it has
    on one device (experts.5.c_fc.weight), so initialisation by name and checkpoints see the same tensors.
    `group`: the ep ranks that share the E experts out."""

    def __init__(self, make_expert, n_experts, group):
        self.ep, rank = dist.get_world_size(group), dist.get_rank(group)
        n_local = n_experts // self.ep
        first = rank * n_local                                  # my experts: first .. first + n_local - 1
        super().__init__({str(e): make_expert(e) for e in range(first, first + n_local)})
        self.group, self.n_experts, self.n_local, self.first = group, n_experts, n_local, first

    def forward(self, rows, expert):
        return dispatch(rows, expert, self.n_experts, self.first, self.n_local, self.group, self.run_experts)

    def run_experts(self, rows, mine, per_expert):
        """rows arrive grouped by source rank, then by my local expert (mine [ep, n_local] counts them on the
        device, per_expert on the host); regroup them by expert, run each expert once on all its rows, and return
        the outputs in arrival order."""
        perm = torch.argsort(local_expert_of_arrived(mine, len(rows), self.n_local), stable=True)   # arrival order
        chunks = rows[perm].split(per_expert)
        out = torch.cat([expert(c) for expert, c in zip(self.values(), chunks)])
        return out[torch.argsort(perm)]


def dispatch(rows, expert, n_experts, first, n_local, group, run):
    """rows [A, h] grouped by expert, `expert` [A] each one's: to the ranks owning their experts (rank r owns
    [r*n_local, (r+1)*n_local)), run(arrived rows, [ep, n_local] table of rows per source and local expert on the
    device, rows per local expert on the host) on them there, and the outputs back, in the order of `rows`. Rows
    with expert == n_experts (dropped by capacity, grouped last) stay here and come back as zeros. The table of
    rows per (rank, expert) is read to the host once: the all_to_all's split sizes and each expert's GEMM need it."""
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    counts = torch.zeros(n_experts + 1, dtype=torch.long, device=expert.device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))      # (bincount would read expert's max back)
    table = gather_counts(counts[:n_experts], group)
    sizes = table.tolist()                                  # [ep][E], the one read
    send_splits = [sum(sizes[me][r * n_local:(r + 1) * n_local]) for r in range(ep)]
    recv_splits = [sum(row[first:first + n_local]) for row in sizes]
    per_expert = [sum(row[first + e] for row in sizes) for e in range(n_local)]
    kept = in_compute_dtype(rows[:sum(send_splits)])   # autocast: dispatched (and returned) in 16 bits, not fp32
    arrived = AllToAll.apply(kept, recv_splits, send_splits, group)   # grouped by expert = by rank
    out = run(arrived, table[:, first:first + n_local], per_expert)
    if arrived.requires_grad and not out.requires_grad:   # no row came (experts that loop over the ids they see
        out = out + arrived                               # skip them all): the exchange back still runs backward
    out = AllToAll.apply(out, send_splits, recv_splits, group)
    dropped = len(rows) - len(kept)
    return torch.cat([out, out.new_zeros(dropped, out.shape[1])]) if dropped else out


def local_expert_of_arrived(mine, n_rows, n_local):
    """The local expert of each arrived row (rows come grouped by source rank, then by local expert; mine
    [ep, n_local] counts them), from the device counts alone (repeat_interleave by them would read them back)."""
    ends = mine.reshape(-1).cumsum(0)                       # where each (rank, expert) run of rows ends
    run = torch.searchsorted(ends, torch.arange(n_rows, device=mine.device), right=True)
    return run % n_local


class ExpertParallelStackedExperts(nn.Module):
    """Drop-in for an MoE's experts stored as one 3-D tensor per weight, [E, ...] (Hugging Face's MoE models,
    grouped GEMMs), called as experts(hidden [N, h], top_k_index [N, k], top_k_weights [N, k]) -> [N, h], each
    token's weighted sum over its k experts. This rank keeps experts [r*E/ep, (r+1)*E/ep): the slice of each
    stacked weight, under that weight's own name (experts.gate_up_proj), so a checkpoint's tensor loads by its
    rows. The rows travel to the rank owning their expert, where `experts` itself (now holding the slice) runs
    them, each with its local expert id and weight 1, and back; the weighting and the sum happen at home."""

    def __init__(self, experts, n_experts, group):
        super().__init__()
        self.ep, rank = dist.get_world_size(group), dist.get_rank(group)
        if n_experts % self.ep:
            raise ValueError(f"expert parallelism: {n_experts} experts do not split evenly over {self.ep} ranks")
        self.n_experts, self.n_local, self.group = n_experts, n_experts // self.ep, group
        self.first = rank * self.n_local
        for name, p in list(experts.named_parameters(recurse=False)):
            if p.dim() < 2 or p.shape[0] != n_experts:
                raise ValueError(f"expert parallelism over stacked experts: {name} {tuple(p.shape)} is not one "
                                 f"tensor of the {n_experts} experts stacked along dim 0")
            local = nn.Parameter(p.detach()[self.first: self.first + self.n_local].clone(), p.requires_grad)
            setattr(experts, name, local)
            self.register_parameter(name, local)
        if hasattr(experts, "num_experts"):         # Hugging Face's experts count theirs (grouped_mm's bins)
            experts.num_experts = self.n_local
        self.__dict__["experts"] = experts          # not a submodule: the parameters are named here, once

    def forward(self, hidden, top_k_index, top_k_weights):
        k = top_k_index.shape[1]
        expert = top_k_index.reshape(-1)
        order = torch.argsort(expert, stable=True)
        token = torch.arange(len(hidden), device=hidden.device).repeat_interleave(k)[order]
        out = dispatch(hidden[token], expert[order], self.n_experts, self.first, self.n_local, self.group,
                       self.run_experts)
        out = out * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden).index_add_(0, token, out.to(hidden.dtype))

    def run_experts(self, rows, mine, per_expert):
        """The arrived rows, each with its local expert (rows come grouped by source rank, then local expert)."""
        local = local_expert_of_arrived(mine, len(rows), self.n_local)
        params = {name: p for name, p in self.named_parameters(recurse=False)}
        return torch.func.functional_call(self.experts, params, (rows, local[:, None], rows.new_ones(len(rows), 1)))


class GroupGradScaler(torch.amp.GradScaler):
    """fp16 loss scaling whose overflow check is agreed over `group`. torch's GradScaler decides per rank
    whether a gradient overflowed; here expert gradients differ between ranks, so one rank could skip a step
    the others take and the replicas would drift apart. After unscale_, each found-inf flag is replaced by
    its maximum over the group, so step() and update() skip (and back off the scale) on every rank or none."""

    def __init__(self, device_type, group, enabled=True):
        super().__init__(device_type, enabled=enabled)
        self.group = group

    def unscale_(self, optimizer):
        super().unscale_(optimizer)
        if self.is_enabled():
            for found_inf in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.group)


def expert_groups(world_size, ep):
    """Every rank's (EP group, expert-replica group): EP groups are ep consecutive ranks; rank r's experts are
    replicated on the ranks with the same r % ep in the other EP groups. Every rank creates every group."""
    ep_groups = [new_group(list(range(g, g + ep))) for g in range(0, world_size, ep)]
    replica_groups = [new_group(list(range(j, world_size, ep))) for j in range(ep)]
    rank = dist.get_rank()
    return ep_groups[rank // ep], replica_groups[rank % ep]


class ExpertDataParallelGrads:
    """Data parallelism with experts sharded: dense gradients averaged over all `data_group` ranks (train_ddp's
    buckets); an expert's gradient already sums the tokens of its whole EP group (the all_to_all brought them),
    so it is averaged over the expert's replicas (`replica_group`) and divided by ep: the same 1/|data_group|
    mean. `named`: (name, parameter) pairs; is_expert(name): whether it is an expert's (is_expert_param for
    model.py's GPT)."""

    def __init__(self, named, data_group, replica_group, ep, bucket_mb, is_expert):
        self.dense = DataParallelGrads([p for n, p in named if not is_expert(n)], data_group, "bucket", bucket_mb)
        self.experts = DataParallelGrads([p for n, p in named if is_expert(n)], replica_group, "bucket", bucket_mb)
        self.ep = ep

    def require_sync(self, sync):
        self.dense.require_sync(sync)
        self.experts.require_sync(sync)

    def finish(self):
        self.dense.finish()
        self.experts.finish()
        torch._foreach_div_(self.experts.grads(), self.ep)

    def zero_grad(self):
        self.dense.zero_grad()
        self.experts.zero_grad()

    def clip(self, max_norm, ep_group):
        """The global grad norm (each expert's gradient counted by its rank, the dense ones, equal on every rank
        after finish(), by the EP group's first rank) and every gradient scaled to at most max_norm."""
        dense, first = self.dense.grads(), dist.get_rank(ep_group) == 0
        owned = self.experts.grads() + (dense if first else [])
        return clip_grad_norm(owned, max_norm, group=ep_group, dtype=(owned or dense)[0].dtype,
                              replicas=[] if first else dense)


# ----------------------------------------------------------------------------------------------------------
# expert parallelism in model.py's GPT (this script and train_5d.py)

def is_expert_param(name):
    return ".mlp.experts." in name


def swap_in_expert_parallel(gpt, ep_group):
    """Give each MoE block of `gpt` ExpertParallelExperts (this rank's experts), on the device the GPT was built
    on (the meta device in train_5d.py); the new parameters are left for init_parameter to fill."""
    from model import MLP, MoE
    for block in gpt.transformer.h:
        if isinstance(block.mlp, MoE):
            block.mlp.experts = ExpertParallelExperts(lambda e: MLP(gpt.cfg), gpt.cfg.n_experts, ep_group)


def expert_parallel_moe(cfg, group):
    """model.MoE with only this rank's E/ep experts: routing and load balancing are model.MoE's, on this rank's
    tokens; its parameters have the single-device names."""
    from model import MLP, MoE
    return MoE(cfg, experts=ExpertParallelExperts(lambda e: MLP(cfg), cfg.n_experts, group))


def expert_parallel_gpt(gcfg, seed, ep_group):
    """model.GPT with each MoE block's experts replaced by its ExpertParallelExperts. The GPT is built on the
    meta device and only then materialised, so no rank ever allocates all E experts."""
    from common.model_setup import materialize
    from model import GPT, init_weights
    with torch.device("meta"):
        model = GPT(gcfg, seed=seed)
        swap_in_expert_parallel(model, ep_group)
    materialize(model, "cpu")
    init_weights(model, seed)                                    # by name: experts by their global index
    return model


# ----------------------------------------------------------------------------------------------------------
# the script

def validate(cfg):
    from common.config import check, grad_accum_steps
    from common.distributed import world_size_from_env
    from common.model_setup import check_moe
    world = world_size_from_env()
    check_moe(cfg)
    check(cfg.n_experts > 0, "expert parallelism needs --n_experts > 0")
    check(cfg.ep >= 1 and world % cfg.ep == 0, f"world size {world} is not divisible by --ep {cfg.ep}")
    check(cfg.n_experts % cfg.ep == 0, f"--n_experts {cfg.n_experts} is not divisible by --ep {cfg.ep}")
    check(cfg.moe_every <= cfg.n_layer, f"--moe_every {cfg.moe_every} > --n_layer {cfg.n_layer}: no MoE block")
    check(grad_accum_steps(cfg, world) > 0, "empty batch")


def checkpoint_holder(name, rank, world, ep):
    """(key, holders, my index) of a tensor for checkpoint.save: an expert is held by its replicas
    (rank r is the (r // ep)-th), everything else by every rank."""
    return ("experts", world // ep, rank // ep) if is_expert_param(name) else ("dense", world, rank)


def main(argv=None):
    # the script's plumbing, imported here: the building blocks above need only torch, comm.py and train_ddp.py
    from common.config import grad_accum_steps, parse_config
    from common.distributed import init_distributed
    from common.metrics import MetricsLogger
    from common.optim import NonFiniteGuard, configure_optimizer, lr_at, set_lr
    from common.routing import end_moe_step, router_metrics, start_moe_training
    from common.evaluation import evaluate, print_sample
    from common.model_setup import MOE_FLAGS, gpt_config
    from common.precision import autocast_context, enable_tf32, param_dtype, resolve_dtype
    from common.startup import prepare_data
    from converters.apply import apply_kernels_and_fp8
    from common import checkpoint
    from common.checkpoint import ModuleState
    from model import flops_per_token
    cfg = parse_config(argv, techniques=("ep", "fp8") + MOE_FLAGS, description=__doc__.split("\n\n")[0],
                       validate=validate)
    env = init_distributed(cfg)
    world = env.world_size
    ep_group, replica_group = expert_groups(world, cfg.ep)
    grad_acc = grad_accum_steps(cfg, world)
    loader = prepare_data(cfg, env)
    enable_tf32(env.device)
    dtype = resolve_dtype(cfg, env.device)

    model = expert_parallel_gpt(gpt_config(cfg, loader.vocab_size), cfg.seed, ep_group).to(env.device,
                                                                                         param_dtype(dtype))
    apply_kernels_and_fp8(model, cfg, env.device)    # as train_single: dense blocks fused, Linears (experts too) FP8
    start_moe_training(model, cfg.global_batch_size * cfg.block_size // world)   # tokens of my step loss
    named = list(model.named_parameters())
    optimizer = configure_optimizer(named, cfg, env.device.type)
    scaler = GroupGradScaler(env.device.type, dist.group.WORLD, enabled=dtype == torch.float16)
    guard = NonFiniteGuard(cfg, env.is_main, scaler)
    torch.manual_seed(cfg.seed + env.rank)           # dropout: each rank masks its own sequences
    held = ModuleState([model], optimizer,                 # experts: written by one of their replicas
                       functools.partial(checkpoint_holder, rank=env.rank, world=world, ep=cfg.ep), scaler=scaler)
    start = checkpoint.start_from(cfg, env, model.cfg, held)   # my experts
    grads = ExpertDataParallelGrads(named, dist.group.WORLD, replica_group, cfg.ep, cfg.bucket_mb, is_expert_param)
    train_model = torch.compile(model) if cfg.compile else model
    amp = autocast_context(dtype, env.device)
    last_step = cfg.stop_step or cfg.max_steps
    logger = MetricsLogger(cfg, env, flops_per_token(model.cfg), n_devices=world, resume=cfg.resume)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if env.is_main:
        print(f"train_ep: world {world}, ep {cfg.ep}, {cfg.n_experts // cfg.ep} of {cfg.n_experts} experts per "
              f"MoE block on each rank, {param_bytes / 2**20:.1f} MiB params per rank, grad_acc {grad_acc}, "
              f"{dtype}, {env.device}, steps {start}..{last_step - 1}", flush=True)

    for step in range(start, last_step):
        t0 = time.perf_counter()
        COMM.reset()
        lr = lr_at(step, cfg)
        set_lr(optimizer, lr)
        loss_sum = 0.0
        for micro in range(grad_acc):
            grads.require_sync(micro == grad_acc - 1)
            x, y = loader.micro_batch(step, micro, cfg.micro_batch_size, env.rank, world)
            with amp:
                _, loss = train_model(x, y)
            scaler.scale(loss / grad_acc).backward()   # the all_to_alls run again, splits swapped
            loss_sum += loss.detach()
        grads.finish()
        comm = dict(COMM.by_op)                        # this step's traffic, before the logging reductions
        scaler.unscale_(optimizer)
        # global norm over the EP group: every rank adds its experts, its rank 0 the (identical) dense grads
        dense_is_mine = dist.get_rank(ep_group) == 0
        dense = grads.dense.grads()
        grad_norm = clip_grad_norm(grads.experts.grads() + (dense if dense_is_mine else []), cfg.grad_clip,
                                   group=ep_group, device=env.device, replicas=[] if dense_is_mine else dense)
        loss_value = mean_over_group(loss_sum / grad_acc, dist.group.WORLD)
        if guard.step_ok(step, loss_value, grad_norm):   # global loss and norm: every rank decides alike
            scaler.step(optimizer)
        scaler.update()
        grads.zero_grad()
        stats = end_moe_step(model, reduce=lambda t: all_reduce(t, group=dist.group.WORLD))   # global batch
        router = router_metrics(stats, cfg.top_k)
        logger.log_step(step, loss_value, lr, float(grad_norm), time.perf_counter() - t0, sum(comm.values()),
                        a2a_bytes=comm.get("all_to_all", 0.0), counts_bytes=comm.get("all_gather", 0.0),
                        grad_bytes=comm.get("all_reduce", 0.0), param_bytes=param_bytes, **router)

        if cfg.eval_interval > 0 and (step % cfg.eval_interval == 0 or step == cfg.max_steps - 1):
            model.eval()                               # every rank evaluates: the experts are collective
            with amp:
                val = evaluate(lambda x, y: train_model(x, y)[1], loader, cfg)
            model.train()
            logger.log_eval(step, val)
        if checkpoint.should_save(cfg, step, last_step):
            checkpoint.save(cfg, model.cfg, step + 1, held)   # each tensor by one of its holders
    logger.close()
    print_sample(model, loader, cfg, env, collective=True)
    return dict(model=model, cfg=cfg)


if __name__ == "__main__":
    from common.distributed import destroy
    main()
    destroy()   # leave the group together: a rank exiting early aborts the others' gloo/NCCL threads
