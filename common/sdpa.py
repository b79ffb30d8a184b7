"""
sdpa.py: which of torch's kernels runs F.scaled_dot_product_attention (model.py's attention core), chosen by
train_single's --sdpa instead of left to torch's defaults.

SDPA runs the first kernel, in a priority list, whose constraints a call meets (dtype, head dim, mask, dropout):

    flash       FlashAttention-2 (CUDA), and a flash-style CPU kernel
    cudnn       cuDNN's fused attention (CUDA; its authors measure it ahead of FlashAttention-2 on H100)
    efficient   xFormers' memory-efficient kernel (CUDA)
    math        the composite of plain matmuls and softmax: runs anywhere, materialises the T x T scores

torch's own order is flash, efficient, math, cudnn: cuDNN's kernel is never reached, since math always runs.
--sdpa auto names the order: flash, cudnn, efficient, math on CUDA (until bench/gpu_check.sh's sdpa row measures
cuDNN faster on a card; then auto can put it first, as --kernels auto waits on its measurement); flash, math on
CPU, where the flash kernel is the faster (fwd+bwd, one thread, causal, [2, 4, 64, 16]: 1.8 vs 2.9 ms fp32, 5.1 vs
6.8 ms float64; both within 3e-15 of each other in float64). A named kernel runs alone: where it cannot run a
call, the step fails instead of falling back unseen, which is what a timing of that kernel needs.
"""
from torch.nn.attention import SDPBackend, sdpa_kernel

from common.errors import fail

KERNELS = dict(flash=SDPBackend.FLASH_ATTENTION, cudnn=SDPBackend.CUDNN_ATTENTION,
               efficient=SDPBackend.EFFICIENT_ATTENTION, math=SDPBackend.MATH)
AUTO = dict(cuda=("flash", "cudnn", "efficient", "math"), cpu=("flash", "math"))
HELP = ("scaled_dot_product_attention's kernel: auto (CUDA: flash, cudnn, efficient, math; CPU: flash, math; the "
        "first that can run a call) | flash | cudnn | efficient | math (that one alone; common/sdpa.py)")


def add_sdpa_flag(parser):
    """--sdpa for parse_config's extra_args (a script's own flag: the scripts that honour it add it)."""
    parser.add_argument("--sdpa", default="auto", choices=["auto", *KERNELS], help=HELP)


def sdpa_order(name, device):
    """The SDPA kernels to try, in order, on `device` for --sdpa `name`; one error line where they cannot run."""
    if name == "auto":
        return [KERNELS[k] for k in AUTO.get(device.type, ("math",))]
    if device.type != "cuda" and name not in AUTO["cpu"]:
        fail(f"--sdpa {name} needs a CUDA GPU (on {device.type}: auto, flash or math)")
    return [KERNELS[name]]


class SdpaKernels:
    """`with` it around forwards (and their backwards follow): SDPA tries these kernels in this order. Unlike
    torch's sdpa_kernel it can be entered again and again (each step, each evaluation)."""

    def __init__(self, name, device):
        self.order, self.entered = sdpa_order(name, device), []

    def __enter__(self):
        context = sdpa_kernel(self.order, set_priority=True)
        context.__enter__()
        self.entered.append(context)
        return self

    def __exit__(self, *exc):
        return self.entered.pop().__exit__(*exc)
