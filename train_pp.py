"""
train_pp.py: pipeline parallelism over train_single.py. The GPT is cut into p stages of consecutive blocks, one
per rank: stage 0 also embeds the tokens, stage p-1 also applies ln_f, the LM head and the loss. A step's global
batch is split into m micro-batches; each flows forward through the stages and its gradient flows back, the
activations and gradients crossing every stage boundary by point-to-point send/recv.

    torchrun --nproc_per_node 4 train_pp.py --pp 4 --pp_schedule 1f1b --n_microbatches 8
    torchrun --nproc_per_node 4 train_pp.py --pp 4 --pp_schedule afab --n_microbatches 8
    torchrun --nproc_per_node 2 train_pp.py --pp 2 --pp_schedule interleaved --pp_virtual 2 --n_layer 8
    torchrun --nproc_per_node 4 train_pp.py --pp 4 --pp_schedule dualpipev --pp_virtual 2 --n_microbatches 8
    python bench/print_schedule.py --pp 4 --n_microbatches 8 --schedule zb1     # just print a schedule

    rank 0: embed + blocks 0..L/p  --act-->  rank 1  --act-->  ...  rank p-1: blocks .. L, ln_f, head, loss
                                   <-grad--          <-grad--

A schedule is each rank's ordered list of actions: F(mb) runs micro-batch mb forward through the rank's stage,
B(mb) runs its backward. Simulated for p = 4, m = 4 with F = 1 and B = 2 ('.' = the rank waits):

    afab (GPipe): all forwards, then all backwards
    rank 0: F0 F1 F2 F3 .  .  .  .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3
    rank 1: .  F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 .  .
    rank 2: .  .  F0 F1 F2 F3 .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  .
    rank 3: .  .  .  F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  .  .  .
    1f1b: warm-up forwards, then one forward / one backward, then cool-down backwards
    rank 0: F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 .  B1 B1 .  B2 B2 .  B3 B3
    rank 1: .  F0 F1 F2 .  .  .  .  B0 B0 F3 B1 B1 .  B2 B2 .  B3 B3 .  .
    rank 2: .  .  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3 .  .  .  .
    rank 3: .  .  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  .  .  .  .  .

Both leave each rank idle (p-1)(F+B) per step, the time the pipe takes to fill and drain: the bubble is
(p-1)/(m+p-1) of a step, so more micro-batches shrink it. AFAB holds the activations of all m micro-batches until
its backwards start; 1F1B starts backwards as soon as the last stage has a loss and holds at most p - rank
micro-batches.

The other schedules live in pipeline/ (make_schedule below picks one by name): interleaved 1F1B (V stages per rank,
round-robin: bubble (p-1)/(V*m+p-1)), zb1 (ZB-H1: the backward split into the input gradient B and the weight
gradient W, the Ws filling the bubbles: (p-1)(F+B-W)), zbv (ZB-V) and dualpipev (DeepSeek-V3's DualPipe, V form):
2 stages per rank placed in a V, (p-1)/(6m+p-1) in chunk units. pipeline/schedules.py has their action lists,
the simulator and the pictures; pipeline/weight_grads.py the split backward; pipeline/gpt_stages.py the GPT's
stages; pipeline/tied.py the embedding shared by the first and the last stage.

Details. Stage s of S = p*V holds blocks [s*L/S, (s+1)*L/S); it is chunk s // p of rank s % p, or in a V rank
pipeline.schedules.rank_of(s). The tied embedding weight is a copy on the first and on the last stage whose two
gradients are summed (one Parameter when one rank holds both ends). A rank sends m * b*T*h * c bytes per step
over each boundary between one of its stages and another rank's, activations forward or gradients back (c = 2
under bf16 autocast, else 4, 8 in float64). The last stage backpropagates loss / m, so gradients equal
train_single's for the same global batch. Tokens are read by the first and last stage from the deterministic
loader, never sent. Dropout draws from each rank's own RNG stream, so runs with --dropout > 0 do not match
train_single bit for bit. Any model (docs/copy_out.md): PipelineRunner runs any stage modules; pipeline/stages.py
cuts a chain of modules.
"""
if __name__ == "__main__":      # run as a script: from here on, torch's import included, a Ctrl-C is one line
    from common.errors import report_interrupts
    report_interrupts()
import contextlib
import time

import torch
import torch.distributed as dist

from common import comm
from common.comm import COMM, label
from pipeline.schedules import (SPLIT_BACKWARD, V_SHAPED, Action, Exchange, Schedule, comm_plan, dualpipe_v,
                                interleaved, placement_of, rank_of, recvs_of, render, schedule_placement, sends_of,
                                simulate, zb_h1, zb_v)
from pipeline.stages import SequentialStage, layer_split, pipeline_stages, stages_of_rank   # noqa: F401


# ----------------------------------------------------------------------------------------------------------
# the schedules this file teaches: one ordered action list per rank

def afab(p, m, rank):
    """All forward, all backward (GPipe): every micro-batch's forward, then every backward in the same order (so
    the gradients add up in train_single's order). Every rank holds all m micro-batches' activations at once."""
    forwards = [Action("F", mb, 0) for mb in range(m)]
    backwards = [Action("B", mb, 0) for mb in range(m)]
    return forwards + backwards


def one_f_one_b(p, m, rank):
    """One forward, one backward: rank r fills the pipe with p-r-1 forwards (warm-up), then runs a forward and the
    backward of its oldest micro-batch in turn (steady state), then the backwards still owed (cool-down). At most
    p - r micro-batches are in flight on rank r instead of m; the bubble is AFAB's."""
    n_warmup = min(p - rank - 1, m)
    n_steady = m - n_warmup
    actions = []
    for mb in range(n_warmup):                   # warm-up: forwards only
        actions.append(Action("F", mb, 0))
    for i in range(n_steady):                    # steady state: a new forward, then the oldest backward
        actions.append(Action("F", n_warmup + i, 0))
        actions.append(Action("B", i, 0))
    for mb in range(n_steady, m):                # cool-down: the backwards of the warm-up's micro-batches
        actions.append(Action("B", mb, 0))
    return actions


def make_schedule(name, p, m, v=1):
    """Action lists of all p ranks for schedule `name` (pipeline.schedules.SCHEDULES), as a Schedule that knows
    where its stages sit (round-robin, or a V)."""
    if name == "interleaved":
        return Schedule([interleaved(p, m, r, v) for r in range(p)])
    if v != (2 if name in V_SHAPED else 1):
        raise ValueError(f"{name} runs {2 if name in V_SHAPED else 1} chunk(s) per rank, not v={v}")
    gen = {"afab": afab, "1f1b": one_f_one_b, "zb1": zb_h1, "zbv": zb_v, "dualpipev": dualpipe_v}[name]
    return Schedule([gen(p, m, r) for r in range(p)], placement_of(name))


# ----------------------------------------------------------------------------------------------------------
# the stage runner: runs this rank's action list with its point-to-point traffic

class PipelineRunner:
    """Runs one rank's actions of a schedule over `group` (the pipeline ranks, in stage order). F receives the
    previous stage's activations, runs the stage and sends its output on; B receives the gradient of that output,
    backpropagates it and sends the gradient of the stage's input back. A stage's input and output are held from
    its F to its B: the in-flight memory the schedule bounds.

    The stages (`chunks`: this rank's v stage modules, in chunk order) are called stage(input, targets):
    input is get_batch(mb)'s x on the first stage and the previous stage's output elsewhere; targets is
    get_batch(mb)'s y on the last stage, else None. A stage returns its output activations, one tensor of
    act_shape (sent in autocast's 16 bits, else act_dtype: the stages' parameter dtype by default; received, it is
    widened to act_dtype), or on the last stage the mean loss (a scalar). A stage has `first` and `last`. `store`: a
    WeightGradStore, for the schedules with W actions (zb1, zbv, dualpipev); `amp`: a context for each stage call
    (autocast; default none); `action_hook(action)`, when set, a context manager around each action's compute
    (metrics.ActionTimer times the pipeline's idle share).

    Sends and receives go out in the batches of pipeline.schedules.comm_plan: a message's sender and receiver put
    it in their batch of the same round, so NCCL, which runs a rank's batches one after another and pairs the k-th
    send a->b with the k-th receive on b, never waits on a batch its partner has not reached (nccl_check.py
    replays the launches). A batch goes out right after the action that produced its sends, one of receives only
    right after the batch before it (posted early, a message arrives while the rank computes); an action waits only
    for its own receives. A sent activation's storage is freed once sent (backward needs only its autograd graph)."""

    def __init__(self, chunks, group, schedules, n_micro, act_shape, device, store=None, amp=None, act_dtype=None):
        self.chunks, self.group, self.schedules, self.n_micro = chunks, group, schedules, n_micro
        self.rank, self.p, self.v = dist.get_rank(group), dist.get_world_size(group), len(chunks)
        self.act_shape, self.device, self.store = act_shape, device, store
        self.amp = contextlib.nullcontext() if amp is None else amp
        self.act_dtype = act_dtype or next(p.dtype for c in chunks for p in c.parameters() if p.is_floating_point())
        with self.amp:       # what crosses stages: autocast's 16 bits (as Megatron sends), else act_dtype (float64)
            self.wire_dtype = comm.compute_dtype(self.act_dtype, torch.device(device).type)
        self.peer = [dist.get_global_rank(group, r) for r in range(self.p)]
        self.plan = comm_plan(schedules, self.p, self.v)[self.rank]   # actions and batches, in launch order
        self.placement = schedule_placement(schedules)                  # stage -> rank: round-robin or a V
        self.last_stage_rank = rank_of(self.p * self.v - 1, self.p, self.placement)   # it has the loss
        self.after_backward = None               # called with each B action when set (ZeRO-2: reduce now)
        self.action_hook = None                  # a context around each action's compute when set (a timer)
        if store is None and any(getattr(a, "kind", None) == "W" for a in self.plan):
            raise ValueError("this schedule has W actions (weight gradients computed later): pass store="
                             "WeightGradStore() and defer_weight_grads(stages, store) (pipeline/weight_grads.py)")

    # ---- messages: (what, micro-batch, receiving stage), see pipeline.schedules.sends_of
    def _launch(self, exchange):
        """One batch (one NCCL group): this round's sends, and receives posted for later actions."""
        ops = []
        for kind, peer, msg in exchange.ops:
            if kind == "send":
                tensor = self.outbox.pop(msg)
            else:
                tensor = torch.empty(self.act_shape, device=self.device, dtype=self.wire_dtype)
            ops.append(comm.p2p_op(kind, tensor, self.peer[peer], self.group))
        works = comm.batch_isend_irecv(ops)
        for i, ((kind, _, msg), op) in enumerate(zip(exchange.ops, ops)):
            work = works[i] if len(works) == len(ops) else works[0]    # NCCL: one work for the whole batch
            if kind == "send":
                self.sending.append((work, op.tensor))
            else:
                self.posted[msg] = (work, op.tensor)

    def _received(self, action):
        """What `action` receives: from this rank's own previous chunk, or a posted receive, waited for."""
        out = []
        for src, msg in recvs_of(action, self.rank, self.p, self.v, self.placement):
            if src == self.rank:
                out.append(self.local.pop(msg))
            else:
                work, buf = self.posted.pop(msg)
                work.wait()
                out.append(buf)
        return out

    def _send(self, action, tensor):
        for dst, msg in sends_of(action, self.rank, self.p, self.v, self.placement):
            if dst == self.rank:                 # next stage on this rank (p == 1, a V's bottom): hand over
                self.local[msg] = tensor.detach()
            else:                                # goes out in the plan's next batch (p2p needs contiguous
                self.outbox[msg] = tensor.contiguous()   # memory: an SP stage output is a transposed view)

    def _free_sent(self, wait=False):
        """Release the storage of sent tensors whose send completed (a forward output keeps its graph)."""
        keep = []
        for work, t in self.sending:
            if wait or work.is_completed():
                work.wait()
                t.untyped_storage().resize_(0)
            else:
                keep.append((work, t))
        self.sending = keep

    def _forward(self, a, received, get_batch):
        stage = self.chunks[a.chunk]
        x, y = get_batch(a.mb) if (stage.first or stage.last) else (None, None)
        inp = x if stage.first else received[0].requires_grad_()   # a leaf: B sends back its .grad
        # a view, not the leaf itself: autocast's cache (kept for the whole step) is meant for weights, not inputs
        with self.amp:
            out = stage(inp if stage.first else inp.view_as(inp).to(self.act_dtype), y if stage.last else None)
        if not stage.first and inp.dtype != self.act_dtype:   # the stage took a widened copy: the 16-bit buffer's
            inp.untyped_storage().resize_(0)                   # values are read no more (backward fills inp.grad)
        if stage.last:
            self.loss_sum += out.detach().to(self.act_dtype)
            out = out / self.n_micro             # mean over the global batch = mean of micro-batch means
        else:                                    # in autocast's 16 bits (ToCopy's backward widens the gradient)
            out = out.to(self.wire_dtype)
            self._send(a, out.detach())          # the residual stream at full width
        self.saved[(a.mb, a.chunk)] = (inp, out)    # held until this micro-batch's B: the in-flight memory

    def _backward(self, a, received):
        inp, out = self.saved.pop((a.mb, a.chunk))
        torch.autograd.backward(out, received[0] if received else None)   # last stage: out = loss / m
        if self.store is not None:
            self.store.close((a.mb, a.chunk))
        if not self.chunks[a.chunk].first:
            self._send(a, inp.grad)

    def _one_cast_per_step(self):
        """One 16-bit copy of each weight per step: autocast caches its casts until its outermost region exits, so
        with a region per forward every micro-batch in flight would hold its own copy (m under AFAB). A disabled
        region around the whole step keeps one cache while backward stays outside autocast."""
        if isinstance(self.amp, torch.autocast):
            return torch.autocast(self.amp.device, enabled=False)
        return contextlib.nullcontext()

    def step(self, actions, get_batch):
        """Run one optimizer step's actions; returns the summed micro-batch losses (0 off the last stage)."""
        assert list(actions) == [a for a in self.plan if not isinstance(a, Exchange)], \
            "step's actions are not this rank's schedule the runner was built with"
        # sends not yet launched / in progress; receives posted; same-rank hand-overs; what B needs
        self.outbox, self.sending, self.posted, self.local, self.saved = {}, [], {}, {}, {}
        self.loss_sum = torch.zeros((), device=self.device, dtype=self.act_dtype)
        with self._one_cast_per_step():
            for a in self.plan:
                self._free_sent()
                if isinstance(a, Exchange):
                    self._launch(a)
                    continue
                received = self._received(a)         # (waiting for them is idle time: outside the hook)
                hook = contextlib.nullcontext() if self.action_hook is None else self.action_hook(a)
                with label(f"pp:{a.kind} mb{a.mb} chunk{a.chunk}"), hook:   # a range in --profile's trace
                    if a.kind == "F":
                        self._forward(a, received, get_batch)
                    elif a.kind == "B":
                        self._backward(a, received)
                        if self.after_backward is not None:
                            self.after_backward(a)
                    else:
                        self.store.compute((a.mb, a.chunk))
        self._free_sent(wait=True)
        assert not (self.saved or self.posted or self.outbox or self.local), "schedule left work"
        return self.loss_sum

    def forward_only_loss(self, x, y):
        """Mean loss of one batch through all stages in order (evaluation); every rank gets it."""
        return self.forward_only(x, y, ())

    @torch.no_grad()
    def forward_only(self, x, y, out_shape, act_shape=None):
        """What the last stage returns for one batch through all stages in order, shaped out_shape, on every rank:
        the mean loss (y given), or without targets what the stage returns then (the next token's logits, for
        sampling: pipeline/gpt_stages.py's PipelineStage). act_shape: of the activations between stages, when not
        the training ones'."""
        S, loss = self.p * self.v, torch.zeros(out_shape, device=self.device, dtype=self.act_dtype)
        owner = [rank_of(s, self.p, self.placement) for s in range(S)]
        for s in (s for s in range(S) if owner[s] == self.rank):    # this rank's stages, in pipeline order
            stage = self.chunks[s // self.p]
            if s > 0 and owner[s - 1] != self.rank:
                shape = act_shape or (x.shape[0],) + tuple(self.act_shape[1:])   # [b, T (/tp under SP), h]
                h = torch.empty(shape, device=self.device, dtype=self.wire_dtype)
                comm.recv(h, self.peer[owner[s - 1]], group=self.group)
            with self.amp:
                h = stage(x if s == 0 else h.to(self.act_dtype), y if s == S - 1 else None)
            h = h.to(self.act_dtype if s == S - 1 else self.wire_dtype)
            if s == S - 1:
                loss = h
            elif owner[s + 1] != self.rank:
                comm.send(h.contiguous(), self.peer[owner[s + 1]], group=self.group)
        comm.broadcast(loss, self.peer[self.last_stage_rank], group=self.group)
        return loss


# ----------------------------------------------------------------------------------------------------------
# the script

def n_microbatches(cfg):
    """(m, micro-batch size): --n_microbatches M sets the micro-batch to global / M."""
    from common.config import check
    by, name = (cfg.n_microbatches, "--n_microbatches") if cfg.n_microbatches > 0 else \
        (cfg.micro_batch_size, "micro_batch_size")
    check(cfg.global_batch_size % by == 0, f"global_batch_size={cfg.global_batch_size} is not divisible by {name}={by}")
    return (by, cfg.global_batch_size // by) if cfg.n_microbatches > 0 else (cfg.global_batch_size // by, by)


def validate(cfg):
    from common.config import check
    from common.distributed import world_size_from_env
    world, p, v, name = world_size_from_env(), cfg.pp, cfg.pp_virtual, cfg.pp_schedule
    check(cfg.n_microbatches >= 0, f"--n_microbatches must be >= 1, or 0 for global / micro_batch_size; got "
                                   f"{cfg.n_microbatches}")
    check(p >= 1 and world == p, f"train_pp.py is pipeline parallel only: --pp {p} must equal the world size "
                                 f"{world} (combine pp with dp/tp/cp in train_5d.py)")
    m, _ = n_microbatches(cfg)
    check_pp(cfg, p, m)
    check(cfg.dtype != "float16", "train_pp.py supports float32, bfloat16 and float64 (fp16 needs a pipeline "
                                  "GradScaler)")


def check_pp(cfg, p, m):
    """What a pipeline of p ranks running m micro-batches per step asks of the run, for train_pp and train_5d alike:
    the schedule's chunks per rank, enough micro-batches to fill it, the layers to cut."""
    from common.config import check
    v, name, stages = cfg.pp_virtual, cfg.pp_schedule, p * cfg.pp_virtual
    check(cfg.n_layer >= stages, f"n_layer={cfg.n_layer} is fewer than pp*pp_virtual={stages} stages")
    uneven = getattr(cfg, "pp_uneven", None)          # a flag of train_pp's only
    check(uneven or cfg.n_layer % stages == 0, f"n_layer={cfg.n_layer} does not split evenly into pp*pp_virtual="
          f"{stages} stages" + (" (pass --pp_uneven to give the first stages one block more)" if uneven is not None
                                else ""))
    check(v == 1 or name == "interleaved" or name in V_SHAPED,
          f"--pp_virtual {v} applies only to --pp_schedule interleaved, zbv and dualpipev")
    check(name != "interleaved" or v >= 2, f"--pp_schedule interleaved needs --pp_virtual >= 2, got {v}")
    check(name not in V_SHAPED or v == 2, f"--pp_schedule {name} places 2 chunks per rank in a V (rank r holds "
                                          f"stages r and 2p-1-r): pass --pp_virtual 2, got {v}")
    check(name != "interleaved" or m % p == 0, f"interleaved 1F1B needs n_microbatches ({m}) divisible by --pp {p}")
    check(name in ("afab", "zbv") or m >= p, f"--pp_schedule {name} needs at least as many micro-batches as "
                                             f"stages: n_microbatches={m} < --pp {p} (use more, or afab or zbv)")
    check(name != "dualpipev" or m >= 2 * p, f"dualpipev needs n_microbatches ({m}) >= 2 * --pp = {2 * p}")


def extra_args(parser):
    parser.add_argument("--pp_uneven", action="store_true", help="allow n_layer not divisible by pp*pp_virtual")
    parser.add_argument("--pp_print_schedule", action="store_true",
                        help="print the schedule as an ASCII timeline (simulated, F=B=W=1) before training")


def main(argv=None):
    # the script's plumbing and the GPT's stages, imported here: the building blocks above need only torch,
    # comm.py and pipeline/'s schedules.py and stages.py
    from common.config import parse_config
    from common.distributed import init_distributed
    from common.metrics import ActionTimer, MetricsLogger
    from common.optim import NonFiniteGuard, configure_optimizer, lr_at, set_lr
    from pipeline.gpt_stages import PipelineSampler, build_stages
    from pipeline.tied import clip_stage_grads, tied_grads_sync, tied_pair_group
    from pipeline.weight_grads import WeightGradStore, defer_weight_grads
    from common.evaluation import evaluate, print_sample
    from common.model_setup import gpt_config
    from common.precision import autocast_context, enable_tf32, param_dtype, resolve_dtype
    from common.startup import prepare_data
    from converters.apply import apply_kernels_and_fp8
    from common import checkpoint
    from common.checkpoint import ModuleState, only_mine
    from model import flops_per_token
    cfg = parse_config(argv, techniques=("pp", "pp_schedule", "pp_virtual", "n_microbatches", "fp8"),
                       description=__doc__.split("\n\n")[0], extra_args=extra_args, validate=validate)
    env = init_distributed(cfg)
    group, p, v = dist.group.WORLD, cfg.pp, cfg.pp_virtual
    rank, (m, micro) = env.rank, n_microbatches(cfg)
    cfg.micro_batch_size = micro                 # what evaluation uses too
    loader = prepare_data(cfg, env)
    enable_tf32(env.device)
    dtype, gcfg = resolve_dtype(cfg, env.device), gpt_config(cfg, loader.vocab_size)

    placement = placement_of(cfg.pp_schedule)   # which stages are mine: round-robin, or a V
    chunks = build_stages(gcfg, rank, p, v, cfg.seed, env.device, param_dtype(dtype), placement)
    for chunk in chunks:                         # as train_single, inside each stage: same parameters
        apply_kernels_and_fp8(chunk, cfg, env.device)
    store = WeightGradStore() if cfg.pp_schedule in SPLIT_BACKWARD else None
    if store is not None:                        # zb1, zbv, dualpipev: the Linears leave dW to the W actions
        defer_weight_grads(chunks, store)
    if cfg.compile:                              # block by block: what crosses stages stays plain tensors
        for block in (b for chunk in chunks for b in chunk.transformer["h"].values()):
            block.compile()
    tied_group = tied_pair_group(p, v, placement)   # first and last stage on two ranks; None in a V
    schedules = make_schedule(cfg.pp_schedule, p, m, v)
    sim = simulate(schedules, p, v)
    runner = PipelineRunner(chunks, group, schedules, m, (micro, cfg.block_size, cfg.n_embd), env.device,
                            store, autocast_context(dtype, env.device), param_dtype(dtype))
    optimizer = configure_optimizer(chunks.named_parameters(), cfg, env.device.type)
    guard = NonFiniteGuard(cfg, env.is_main)
    torch.manual_seed(cfg.seed + rank)           # this rank's dropout stream
    held = ModuleState(chunks, optimizer, only_mine)     # my stages: every rank writes its own
    start = checkpoint.start_from(cfg, env, gcfg, held)   # my stages' parts
    last_step = cfg.stop_step or cfg.max_steps
    logger = MetricsLogger(cfg, env, flops_per_token(gcfg), n_devices=p, resume=cfg.resume)
    if env.is_main:
        if cfg.pp_print_schedule:
            print(render(sim, v), flush=True)
        print(f"train_pp: {p} stages x {v} chunks, schedule {cfg.pp_schedule}, {m} micro-batches of {micro}, "
              f"simulated bubble {sim['idle_share'][0]:.3f}, {dtype}, steps {start}..{last_step - 1}",
              flush=True)
    dist.barrier(group=group)                    # every pipeline rank is up before the first send
    idle_fracs, timer = [], ActionTimer(env.device)   # per step: the schedule's share of time spent waiting
    runner.action_hook = timer
    p2p_bytes, step_bytes = 0, 0                        # what a resume at the last step, which runs none, returns

    for step in range(start, last_step):
        COMM.reset()
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        set_lr(optimizer, lr)
        timer.start()
        loss_sum = runner.step(schedules[rank], lambda mb: loader.micro_batch(step, mb, micro))
        timer.stop()
        p2p_bytes = COMM.bytes_sent
        tied_grads_sync(chunks, tied_group)
        grad_norm = clip_stage_grads(chunks, cfg.grad_clip, group, env.device)
        comm.broadcast(loss_sum, dist.get_global_rank(group, runner.last_stage_rank), group=group)   # it has it
        loss_value = float(loss_sum) / m
        if guard.step_ok(step, loss_value, grad_norm):   # global loss and norm: every stage decides alike
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_time = time.perf_counter() - t0
        idle_fracs.append(timer.idle_fraction())
        logger.log_step(step, loss_value, lr, float(grad_norm), step_time, step_bytes := COMM.bytes_sent,
                        p2p_bytes=p2p_bytes, idle_frac=idle_fracs[-1], bubble_sim=sim["idle_share"][rank],
                        bubble_sim_run=simulate(schedules, p, v, **timer.costs())["idle_share"][rank])

        if cfg.eval_interval > 0 and (step % cfg.eval_interval == 0 or step == cfg.max_steps - 1):
            chunks.eval()
            val = evaluate(runner.forward_only_loss, loader, cfg)
            chunks.train()
            logger.log_eval(step, val)
        if checkpoint.should_save(cfg, step, last_step):
            checkpoint.save(cfg, gcfg, step + 1, held)   # the stages' parts, written in parallel
    logger.close()

    # measured idle share per rank (median over the steps after the first) next to the simulator's
    steady = sorted(idle_fracs[1:] or idle_fracs or [0.0])
    idle_all = torch.empty(p, device=env.device)
    comm.all_gather(idle_all, torch.tensor([steady[len(steady) // 2]], device=env.device), group=group)
    if env.is_main:
        print("idle per rank, measured " + " ".join(f"{x:.3f}" for x in idle_all.tolist()) + " | simulated "
              + " ".join(f"{i:.3f}" for i in sim["idle_share"]), flush=True)
    # the sample runs through the pipeline (every rank its own stages), never gathering the model on one rank
    print_sample(PipelineSampler(runner, chunks, gcfg), loader, cfg, env, collective=True)
    return dict(chunks=chunks, cfg=cfg, gcfg=gcfg, group=group, p2p_bytes=p2p_bytes, comm_bytes=step_bytes,
                idle=idle_all.tolist(), sim=sim)


if __name__ == "__main__":
    from common.distributed import destroy
    main()
    destroy()   # leave the group together: a rank exiting early aborts the others' gloo/NCCL threads
