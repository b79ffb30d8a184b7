"""
What a training step would make a GPU wait for, recorded on a CPU (DESIGN.md, "Tests"): host-to-device copies
and reads of device values on the host (`.item()`, `float()`, `.tolist()` ...), each a full stop of the host
until the GPU has caught up.

On a CPU every tensor lives on the host, so the device cannot be read off a tensor. It is read off the code
instead, as it would run on a GPU: a factory call with no `device=` (torch.arange(n), torch.tensor([...])) makes
a tensor on the host wherever the step runs, and so does any op whose tensor inputs are all such host tensors.
Every other tensor (parameters, the batch, activations, a factory with `device=x.device`) is on the compute
device. A TorchFunctionMode sees each call with the arguments as written (a TorchDispatchMode would see the
device already filled in), tags host tensors and records:

    copy   a host tensor moved to a device (.to(device), .to(tensor), .cuda(), device.copy_(host)), or host data
           made into a device tensor (torch.tensor(3.0, device=x.device): a host-to-device copy of the value)
    mixed  a host tensor of one or more dimensions in an op with a device tensor (an implicit copy, or on CUDA
           a device-mismatch error; a 0-dim host tensor is a scalar argument and fine)
    sync   .item() / float() / int() / bool() / .tolist() of a device tensor; and an op whose output's size
           depends on a device tensor's values, which CUDA must read back to the host to allocate that output:
           bincount (its min and max), nonzero / argwhere / one-argument where, indexing or assigning with a
           boolean mask (a nonzero inside), repeat_interleave with tensor repeats and no output_size (their
           sum), unique / unique_consecutive, masked_select

Each event names the innermost line of the repository (outside tests/) that led to it. The recorder runs from
the MetricsLogger's creation (after the model, optimizer and checkpoint are set up) to its close, and numbers
events by the optimizer step they fall in: the step of the training batch read last (every loop reads its step's
micro-batches first; the rows of a step may be logged later, train_single's at its log steps).
"""
import dataclasses
import linecache
import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

FACTORIES = {torch.arange, torch.tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.linspace,
             torch.logspace, torch.eye, torch.rand, torch.randn, torch.randint, torch.randperm, torch.scalar_tensor,
             torch.as_tensor}
FROM_HOST_DATA = {torch.tensor, torch.as_tensor}        # their values come from Python data on the host
SYNCS = {torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__,
         torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.numpy}
SIZED_BY_VALUES = {torch.bincount, torch.Tensor.bincount, torch.nonzero, torch.Tensor.nonzero, torch.argwhere,
                   torch.Tensor.argwhere, torch.unique, torch.Tensor.unique, torch.unique_consecutive,
                   torch.Tensor.unique_consecutive, torch.masked_select, torch.Tensor.masked_select}
REPEATS = {torch.repeat_interleave, torch.Tensor.repeat_interleave}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put}
MOVES = {torch.Tensor.to, torch.Tensor.cuda}
HOST = "_made_on_host"


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str        # copy | mixed | sync
    step: int        # optimizer steps logged before it
    where: str       # "file:function: code" of the innermost repository line
    what: str        # the torch call


def repo_line():
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(ROOT + os.sep) and not path.startswith(TESTS) and "site-packages" not in path:
            code = linecache.getline(path, frame.f_lineno).strip()
            return f"{os.path.relpath(path, ROOT)}:{frame.f_code.co_name}: {code}"
        frame = frame.f_back
    return "<outside the repository>"


def is_host(t):
    return isinstance(t, torch.Tensor) and getattr(t, HOST, False)


def sized_by_values(func, args, kwargs):
    """An op whose output size CUDA can only know by reading a device tensor's values (see the docstring)."""
    if func in SIZED_BY_VALUES:
        return True
    if func is torch.where:
        return len(args) + len(kwargs) == 1
    if func in REPEATS:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if func in INDEXING:
        index = tree_flatten(args[1] if len(args) > 1 else kwargs.get("indices"))[0]
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 0 for i in index)
    return False


def names_a_device(args, kwargs):
    """Tensor.to's arguments move it to a device (not only cast it): a device, a device string, a tensor."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])


class StepRecorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.events, self.step = [], 0

    def record(self, kind, func):
        self.events.append(Event(kind, self.step, repo_line(), getattr(func, "__qualname__", str(func))))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host = [t for t in tensors if is_host(t)]
        out = func(*args, **kwargs)
        if func in SYNCS:
            if tensors and not host:
                self.record("sync", func)
            return out
        if tensors and not host and sized_by_values(func, args, kwargs):
            self.record("sync", func)
            return out
        if func in MOVES and host and args[0] is host[0] and (func is torch.Tensor.cuda or names_a_device(args, kwargs)):
            self.record("copy", func)
            self.tag(out, False)
            return out
        if func is torch.Tensor.copy_ and len(args) > 1 and is_host(args[1]) and not is_host(args[0]):
            self.record("copy", func)
            return out
        if func in FACTORIES and not (tensors and func is torch.as_tensor):
            if func in FROM_HOST_DATA and kwargs.get("device") is not None:
                self.record("copy", func)
            self.tag(out, kwargs.get("device") is None)
        elif host and len(host) < len(tensors):
            if any(t.dim() > 0 for t in host):
                self.record("mixed", func)
        elif host:
            self.tag(out, True)
        return out

    @staticmethod
    def tag(out, host):
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                setattr(t, HOST, host)


def record_steps(fn, recorder=None):
    """fn() with a StepRecorder (or another mode with a `step` and `events`) on from the MetricsLogger's creation to
    its close; returns (fn's result, the recorder's events)."""
    from common import data, data_mix, metrics
    recorder = StepRecorder() if recorder is None else recorder
    logger_cls, loaders = metrics.MetricsLogger, (data.GlobalBatchLoader, data_mix.MixtureLoader)
    init, close, reads = logger_cls.__init__, logger_cls.close, [cls.micro_batch for cls in loaders]

    def init_then_record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        recorder.__enter__()

    def read_and_count(read):
        def micro_batch(self, step, *args, **kwargs):
            if kwargs.get("split", args[4] if len(args) > 4 else "train") == "train":   # not an evaluation's
                recorder.step = step
            return read(self, step, *args, **kwargs)
        return micro_batch

    def stop_then_close(self):
        close(self)             # the rows still waiting are read in close: inside the last step
        recorder.__exit__(None, None, None)

    logger_cls.__init__, logger_cls.close = init_then_record, stop_then_close
    for cls, read in zip(loaders, reads):
        cls.micro_batch = read_and_count(read)
    try:
        result = fn()
    finally:
        logger_cls.__init__, logger_cls.close = init, close
        for cls, read in zip(loaders, reads):
            cls.micro_batch = read
        if torch.overrides._get_current_function_mode() is recorder:     # fn failed with the recorder on
            recorder.__exit__(None, None, None)
    return result, recorder.events


def recorded_step_events(rank, world_size, script, argv):
    """A worker for distributed_helper.run_workers: script.main(argv) under record_steps; this rank's events."""
    import importlib
    main = importlib.import_module(script).main
    return record_steps(lambda: main(argv))[1]
