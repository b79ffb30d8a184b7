"""
Kernel launches per training step, counted on CPU and held to a budget: on a GPU each launch costs a few
microseconds of host time whatever its size, so an extra small op in every layer (a cast, a copy, an unfused
element-wise step) is a slower step even where its FLOPs are nothing. A TorchDispatchMode counts the aten ops that
compute a tensor (views are not launches) in a steady-state train_single step, numbered by step as
tests/step_syncs.py numbers host reads.

The budgets are today's counts for the tiny fp32 model (dense GeLU blocks, SDPA, grad_acc 2): a change that adds
ops per layer or per step fails here, and one that removes some should lower the budget with it.
"""
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from step_syncs import record_steps
from train_helpers import tiny_argv

PER_LAYER = 102     # one block, forward + backward of 2 micro-batches + the second one's gradient accumulation
PER_STEP = 92      # the rest: embedding, final norm, head and loss, clipping, AdamW, the guard, the loss sum


class LaunchCounter(TorchDispatchMode):
    """Counts, per step, the aten ops that make or write a tensor."""

    def __init__(self):
        super().__init__()
        self.step, self.events = 0, collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        makes = any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0])
        if not func.is_view and (makes or func._schema.is_mutable):     # (in-place foreach ops return nothing)
            self.events[self.step][func.overloadpacket.__name__] += 1
        return out


def launches_in_step_1(tiny_data, out_dir, n_layer):
    import train_single
    argv = tiny_argv(tiny_data, out_dir, max_steps=3, global_batch_size=4, micro_batch_size=2, n_layer=n_layer)
    return record_steps(lambda: train_single.main(argv), LaunchCounter())[1][1]


def test_launches_per_step_stay_within_budget(tiny_data, tmp_path):
    torch.set_num_threads(1)
    two, three = (launches_in_step_1(tiny_data, str(tmp_path / f"L{n}"), n) for n in (2, 3))
    per_layer = three - two
    assert sum(per_layer.values()) <= PER_LAYER, sorted(per_layer.items(), key=lambda kv: -kv[1])
    rest = two - per_layer - per_layer
    assert sum(rest.values()) <= PER_STEP, sorted(rest.items(), key=lambda kv: -kv[1])
    # the optimizer and the clipping are one launch per kind of work for all parameters, not one per tensor: fused
    # AdamW for each of its two groups (decayed or not), one norm over every gradient, one in-place scale
    assert two["_fused_adamw_"] == three["_fused_adamw_"] == 2 and two["_foreach_norm"] == 1, two
    assert two["_foreach_mul_"] == three["_foreach_mul_"] == 1
    # no complex numbers: RoPE is real arithmetic
    assert not any("complex" in name for name in per_layer), per_layer
