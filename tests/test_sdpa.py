"""--sdpa (common/sdpa.py): SDPA's kernels named in order, the order honoured inside the context (forward and the
backward that follows, each step again), and a kernel a CPU cannot run refused in one line before any work."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode

from common.sdpa import SdpaKernels, sdpa_order


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def attention_ops(kernels):
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    with OpNames() as ops, kernels:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    return ops.names


def test_auto_names_the_order_per_device():
    assert sdpa_order("auto", torch.device("cpu")) == [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    assert sdpa_order("auto", torch.device("cuda")) == [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                                        SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    assert sdpa_order("cudnn", torch.device("cuda")) == [SDPBackend.CUDNN_ATTENTION]


def test_the_named_kernel_runs_forward_and_backward_and_the_context_reenters():
    flash = SdpaKernels("auto", torch.device("cpu"))
    math_only = SdpaKernels("math", torch.device("cpu"))
    for _ in range(2):                                  # entered again each step
        assert "_scaled_dot_product_flash_attention_for_cpu_backward" in attention_ops(flash)
        names = attention_ops(math_only)
        assert not any("flash" in n for n in names) and "_softmax_backward_data" in names, names
    assert "_scaled_dot_product_flash_attention_for_cpu" in attention_ops(SdpaKernels("flash", torch.device("cpu")))


def test_a_gpu_kernel_on_cpu_is_one_error_line(tiny_data, tmp_path, capsys):
    import train_single
    from train_helpers import tiny_argv
    with pytest.raises(SystemExit) as stop:
        train_single.main(tiny_argv(tiny_data, str(tmp_path), sdpa="cudnn", max_steps=1))
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and err == ["error: --sdpa cudnn needs a CUDA GPU (on cpu: auto, flash or math)"]
