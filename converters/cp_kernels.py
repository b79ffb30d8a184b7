"""
converters/cp_kernels.py: context parallelism's block attention (train_cp.py) meets the fused kernels here. The ring
and all-gather attentions run any (forward, backward) pair of train_cp.PLAIN_TORCH's signatures; this picks a
fused one for --kernels (train_cp.block_attention_kernel asks, for train_cp and train_5d alike):

    --kernels triton      kernels/flash_attention.py's pair
    CPU                   torch's fused CPU kernel (SDPA_CPU below, exact in float64 too)
    CUDA                  aten's flash / memory-efficient pair (kernels/attention_lse.py), which never holds a
                          [Tq, Tk] score matrix; none under --kernels torch, or where none applies (float64)
"""
import torch

from kernels.attention_lse import fused_block_attention
from kernels.flash_attention import flash_attention_backward, flash_attention_forward

# torch's fused CPU attention exposes the pair as (private) aten ops: ~9x faster than the plain-torch one on CPU
SDPA_CPU = (lambda q, k, v, causal: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal),
            lambda do, q, k, v, o, lse, causal: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do, q, k, v, o, lse, 0.0, causal))


def fused_block_kernel(kernels, device, dtype, head_dim):
    """The fused (forward, backward) pair for --kernels `kernels` on `device`, or None: the caller's plain-torch
    reference runs (--kernels torch on CUDA, or no fused pair for this dtype and head dim)."""
    if kernels == "triton":
        return flash_attention_forward, flash_attention_backward
    if device.type == "cpu":
        return SDPA_CPU
    return None if kernels == "torch" else fused_block_attention(device, dtype, head_dim)
