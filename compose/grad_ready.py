"""
compose/grad_ready.py: the data-parallel reduction of a pipelined step started where the schedule is done with a
gradient, not after the whole schedule (train_5d.py's replicas and ZeRO-1, with train_ddp's buckets).

With gradient accumulation a parameter's gradient is final only after the last micro-batch's backward, and
autograd's hooks cannot tell that backward from the others. A pipeline schedule can: it is a plain list of actions
(pipeline/schedules.py), so each chunk's last action that writes gradients is known before the step starts: its
last B, or where the schedule splits the backward (zb1, zbv, dualpipev) its last W, since dW comes in W. After that
action the chunk's gradients are told final to the reductions (grads_ready below, train_ddp.DataParallelGrads'
hooks' bookkeeping), which launch every bucket they complete, async; the step waits for them after the schedule.
A later stage finishes its backwards first, so its reduction runs under the earlier stages' cool-down, and with
several chunks per rank (interleaved, a V) a chunk's buckets run under the other chunk's last backwards:

    1f1b, p = 2, m = 4 (F = 1, B = 2):  ###: the stage's buckets reduced (before: both from the end of the step)
    rank 0: F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3 ###
    rank 1: .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 ###

A parameter two chunks share (the tied embedding of a V) is final after the later chunk's last writer. Under
sequence parallelism the norms' gradients are partial sums over tp (tp_grads.py), summed just before they are told
final, so the reduction gets what it got when the sum came after the whole schedule. A `hold` parameter is left to
the step's end: the tied weight's copy, whose sum with the copy on another pipeline rank comes first (waiting for that
rank in the middle of the schedule would stall the pipeline). Every rank of a data-parallel group runs the same
action list, so all launch the same buckets in the same order.

ZeRO-2 under zb1, zbv and dualpipev: B runs without sync (its dW is still to come) and W writes the weights'
gradients itself, outside autograd's hooks, so after each W the gradients the chunk's parameters hold are
reduce-scattered and dropped (reduce_held), keeping no full gradients.
"""
from collections import defaultdict

from pipeline.schedules import Action
from common.tp_grads import sum_sequence_parallel_grads
from train_ep import ExpertDataParallelGrads


def last_grad_writers(actions):
    """{chunk: its last action that writes parameter gradients}: a B, or a W where the schedule has W actions."""
    last = {}
    for a in actions:
        if a.kind != "F":
            last[a.chunk] = a
    return last


def grads_ready(grads, params):
    """Count the gradients of those of `params` in the buckets of `grads` (a train_ddp.DataParallelGrads, train_zero's
    ShardedGrads, or train_ep's ExpertDataParallelGrads: each of its two reduces only its own) as final now, as
    their hooks would, while the hooks are off (require_sync(False)) as gradients still accumulate. Complete
    buckets launch at once, in index order."""
    if isinstance(grads, ExpertDataParallelGrads):
        for part in (grads.dense, grads.experts):
            grads_ready(part, params)
        return
    sync = grads.sync
    grads.require_sync(True)
    for p in params:
        if id(p) in grads.bucket_of:
            grads._grad_ready(p)
    grads.require_sync(sync)


def reduce_held(grads):
    """ZeRO-2 (train_zero.ShardedGrads at stage 2): reduce-scatter the gradients the parameters hold now and drop
    them, for gradients written outside autograd's hooks (a zero-bubble pipeline's W sets .grad itself; its B ran
    without sync)."""
    held = [p for b in grads.buckets for p in b.params if p.grad is not None]
    if not held:
        return
    grads_ready(grads, held)             # every bucket they complete launched, as their hooks would
    grads.require_sync(True)             # (finish waits only for a step that syncs)
    grads.finish()
    grads.require_sync(False)


class GradsReadyBySchedule:
    """Tells `reductions` (those grads_ready above takes) which parameters of `chunks` (this rank's stage modules,
    indexed by Action.chunk) are final after each action of `actions` (this rank's list of one step).
    tp_group: sequence-parallel gradients are summed over it first; hold: a parameter not told (or None)."""

    def __init__(self, chunks, actions, reductions, tp_group=None, hold=None):
        position = {a: i for i, a in enumerate(actions)}
        last = last_grad_writers(actions)
        holders = {}                              # id -> (parameter, the chunks holding it)
        for i, chunk in enumerate(chunks):
            for p in chunk.parameters():
                holders.setdefault(id(p), (p, []))[1].append(i)
        self.final_after = defaultdict(list)      # action -> the parameters it finishes
        for p, held_by in holders.values():
            if p is not hold and p.requires_grad:
                self.final_after[max((last[c] for c in held_by), key=position.get)].append(p)
        self.reductions, self.tp_group = reductions, tp_group

    def after_backward(self, action):
        """The runner's hook after a B action (train_pp.PipelineRunner.after_backward)."""
        params = self.final_after.get(action)
        if params:
            if self.tp_group is not None:
                sum_sequence_parallel_grads(params, self.tp_group)
            for grads in self.reductions:
                grads_ready(grads, params)

    def after_weight_grads(self, key):
        """The WeightGradStore's hook after a W action (its key: micro-batch, chunk)."""
        self.after_backward(Action("W", *key))
