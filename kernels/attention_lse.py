"""
Block attention that returns its log-sum-exp, from aten's fused kernels: what context parallelism (train_cp.py)
merges block by block. Each pair has train_cp's signatures:

    forward(q, k, v, causal) -> out [B, H, Tq, D] (q's dtype), lse [B, H, Tq] (fp32)
    backward(dout, q, k, v, out, lse, causal) -> dq, dk, dv       (out, lse: the *final* ones, merged over blocks)

The backward of a flash kernel recomputes P = exp(S - lse) from the lse it is given and takes rowsum(dO * O) from
the out it is given, so given the merged out and lse it returns one block's exact share of the gradient (the
identity train_cp.attention_backward writes out). No [Tq, Tk] score matrix is ever materialized.

    kernel          device  dtypes                  head dim               source
    FLASH_CUDA      CUDA    fp16, bf16              multiple of 8, <= 256  aten flash attention (FlashAttention-2),
                                                                           compute capability >= 8.0
    EFFICIENT_CUDA  CUDA    fp16, bf16, fp32        multiple of 16 bytes   aten memory-efficient attention (xFormers'
                                                                           cutlass kernel); lse padded to 32 rows
    converters/cp_kernels.SDPA_CPU, train_cp.PLAIN_TORCH: the CPU's fused kernel, the plain-torch reference (float64 too).

Causal masks only ever apply to diagonal blocks (Tq == Tk, the same positions), where top-left and bottom-right
alignment agree. Checked here without a GPU: the CUDA ops' schemas and output shapes on the meta device in the
installed torch, and these wrappers (argument order, lse padding) against an emulation of the ops on CPU
(tests/test_cp.py); run on an H200 by bench/gpu_check.sh's CP row. `--kernels torch` keeps train_cp on the plain-torch reference there.
"""
import torch
import torch.nn.functional as F

aten = torch.ops.aten


def flash_forward(q, k, v, causal):
    out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
    return out, lse


def flash_backward(dout, q, k, v, out, lse, causal):
    # cum_seq_q/k: None for dense batches; max_q/k: the lengths; rng state: unused without dropout
    none = torch.empty(0, dtype=torch.uint64, device=q.device)
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[-2], k.shape[-2], 0.0, causal, none, none)


def efficient_forward(q, k, v, causal):
    out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[:2]
    return out, lse[..., : q.shape[-2]]             # the kernel pads its lse to a multiple of 32 rows


def efficient_backward(dout, q, k, v, out, lse, causal):
    pad = -q.shape[-2] % 32
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    grads = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, F.pad(lse, (0, pad)).contiguous(), seed, seed, 0.0, [True, True, True, False],
        causal)
    return grads[:3]


FLASH_CUDA = (flash_forward, flash_backward)
EFFICIENT_CUDA = (efficient_forward, efficient_backward)


def fused_block_attention(device, dtype, head_dim, capability=None):
    """The aten pair for these blocks on `device`, or None where none applies (CPU, float64: train_cp's own).
    capability: the GPU's (major, minor), torch.cuda.get_device_capability(device) when not given."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    capability = capability or torch.cuda.get_device_capability(device)
    if dtype != torch.float32 and head_dim % 8 == 0 and head_dim <= 256 and capability >= (8, 0):
        return FLASH_CUDA
    if head_dim % (128 // torch.finfo(dtype).bits) == 0:       # 16-byte aligned rows
        return EFFICIENT_CUDA
    return None
