"""
The CUDA stream calls of a piece of code, recorded on a CPU: a stand-in for torch.cuda (Stream, Event,
current_stream, stream) that runs nothing asynchronously and logs, in order, what each stream was asked to do.

    cuda = FakeCuda()
    with cuda.recording():                  # also logs the non_blocking copies and record_stream calls of tensors
        ...code that takes `cuda` in place of torch.cuda...
    cuda.log                                # [(stream name, what, detail)], e.g. ("side", "wait", "event 3")

A FakeStream has no wait_stream: code checked with it may only wait for events (one copy), never for everything a
stream was given so far. An event has passed by the time it is queried (the GPU caught up).
"""
import contextlib
import itertools

import torch


class FakeEvent:
    def __init__(self, cuda):
        self.cuda, self.name = cuda, f"event {next(cuda.numbers)}"

    def record(self, stream):
        self.cuda.log.append((stream.name, "record", self.name))

    def query(self):
        return True


class FakeStream:
    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name

    def wait_event(self, event):
        self.cuda.log.append((self.name, "wait", event.name))


class FakeCuda:
    def __init__(self):
        self.log, self.numbers = [], itertools.count()
        self.compute = FakeStream(self, "compute")
        self.current = self.compute

    def Stream(self, device=None):       # noqa: N802 (torch.cuda's name)
        return FakeStream(self, "side")

    def Event(self):                     # noqa: N802
        return FakeEvent(self)

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def recording(self):
        return recording_copies(self)


@contextlib.contextmanager
def recording_copies(cuda):
    """Logs each non_blocking copy (Tensor.copy_, Tensor.to) on the stream current at the call, and each
    record_stream (not run: a CPU tensor takes no stream). A non_blocking .to() on the CPU returns a new tensor, as
    the copy to a GPU would, never its input. The methods are swapped on torch.Tensor itself, not by a
    TorchFunctionMode: a checkpoint's recompute runs inside autograd's backward, where no mode is on."""
    copy_, to, record_stream = torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.record_stream

    def logged_copy_(self, src, non_blocking=False):
        if non_blocking:
            cuda.log.append((cuda.current.name, "copy out", tuple(src.shape)))
        return copy_(self, src, non_blocking=non_blocking)

    def logged_to(self, *args, **kwargs):
        if not kwargs.get("non_blocking"):
            return to(self, *args, **kwargs)
        cuda.log.append((cuda.current.name, "copy back", tuple(self.shape)))
        return self.clone()

    def logged_record_stream(self, stream):
        cuda.log.append((stream.name, "owns", tuple(self.shape)))

    torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.record_stream = logged_copy_, logged_to, logged_record_stream
    try:
        yield
    finally:
        torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.record_stream = copy_, to, record_stream
