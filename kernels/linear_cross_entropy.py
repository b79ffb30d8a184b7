"""
kernels/linear_cross_entropy.py: the LM head and the cross-entropy loss fused and chunked over tokens, so the
[tokens, vocab] logits never exist at once; the gradients for h and the weight are computed in the same pass.
Replaces model.py's LMHead (F.linear + F.cross_entropy) via apply_kernels.

    loss = linear_cross_entropy(h, weight, targets)    # h [N, C], weight [V, C], targets [N] -> mean CE (fp32)

For each chunk of n tokens (n >= 2048, or all of them: a GEMM of thousands of rows keeps the tensor cores busy
while streaming the [V, C] weight, which each chunk reads three times):
    z = h_c W^T                                 [n, V], the only vocab-sized buffer, reused in place:
    loss_c = sum_i (logsumexp(z_i) - z_i[t_i])  the row kernel: online max/sum over vocabulary blocks, then
    z <- (softmax(z) - onehot(t)) / N_valid     the logit gradient written over the logits
    dh_c = z W ;  dW += z^T h_c                 two GEMMs; the second writes straight into one fp32 dW buffer
                                                (cuBLAS accumulates bf16 products into fp32 C: no per-chunk
                                                [V, C] temporary or cast), cast to W's dtype once at the end
backward only scales the stored dh, dW by the incoming gradient (the loss is the graph's end in training).
Under a zero-bubble pipeline (defer=) the forward skips dW and the W step makes a second pass over the chunks for
it: the same ops in the same order, so the same dW, for one more GEMM (docs/pipelines.md, "The W step").

Memory (fp32, N tokens, vocab V): the unfused head keeps N*V logits, makes an fp32 copy for the loss, the
softmax and the logit gradient: about 3-4 x 4*N*V bytes at peak. Fused: n*V in h's dtype for one chunk plus dh
(N*C) and an fp32 dW (4*V*C). Measured on CPU, fp32, 4096 tokens, C = 768, V = 50304, with 256-token chunks
(bench/kernels_lm_head.py): 2413 MiB working memory unfused vs 349 MiB fused; 2048-token chunks add
4*1792*V bytes (~344 MiB) to that in fp32, and in bf16 at GPT-2-small's 8192 tokens the fused head still keeps
under a quarter of the unfused head's logits.
The row kernel on a GPU: one row per program of 16 warps, 8192 vocabulary entries per step (a 50k row in
7 steps, 16 values per thread per step), so a [2048, 50304] chunk is 2048 programs that stream it at memory
speed (Liger-Kernel's cross-entropy sizes its row programs the same way).
Targets equal to ignore_index (-100, as F.cross_entropy) count neither in the loss nor in the mean.
Precision: the row kernel works in fp32 for 16-bit and fp32 logits and in float64 for float64 logits (the
per-row losses too), so the float64 exactness runs keep the fused head in float64.
"""
import functools

import torch
import torch.nn.functional as F

from kernels.backend import (HAS_TRITON, compute_dtype, compute_type, maybe_compiled, next_pow2, tl, triton,
                             use_triton)

if HAS_TRITON:
    @triton.jit
    def _ce_grad_rows(Z, T, Loss, InvN, M, V, stride, ignore_index, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
                      ACC: tl.constexpr):
        """Rows r of Z (ROWS per program): Loss[r] = lse - z[t]; Z[r] <- (softmax - onehot(t)) * inv_n, in place.
        inv_n is read from device memory: the host never waits for the count of valid targets."""
        inv_n = tl.load(InvN).to(ACC)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = rows < M
        z_rows = Z + rows.to(tl.int64)[:, None] * stride
        t = tl.load(T + rows, mask=live, other=ignore_index)
        m = tl.full([ROWS], float("-inf"), dtype=ACC)
        s = tl.zeros([ROWS], dtype=ACC)
        for v0 in range(0, V, BLOCK_V):         # pass 1: online max and sum of exponentials
            cols = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(z_rows + cols[None, :], mask=live[:, None] & (cols[None, :] < V),
                        other=float("-inf")).to(ACC)
            m_new = tl.maximum(m, tl.max(z, axis=1))
            m_new = tl.where(live, m_new, 0.0)  # rows past the end stay finite (they are never stored)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
            m = m_new
        lse = m + tl.log(tl.where(live, s, 1.0))
        valid = live & (t != ignore_index)
        z_t = tl.load(Z + rows.to(tl.int64) * stride + t, mask=valid, other=0.0).to(ACC)
        tl.store(Loss + rows, tl.where(valid, lse - z_t, 0.0), mask=live)
        scale = tl.where(valid, inv_n, 0.0)
        for v0 in range(0, V, BLOCK_V):         # pass 2: the gradient, written over the logits
            cols = v0 + tl.arange(0, BLOCK_V)
            mask = live[:, None] & (cols[None, :] < V)
            z = tl.load(z_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            g = (tl.exp(z - lse[:, None]) - tl.where(cols[None, :] == t[:, None], 1.0, 0.0)) * scale[:, None]
            tl.store(z_rows + cols[None, :], g.to(Z.dtype.element_ty), mask=mask)


def _at_least_fp32(z):
    return z if z.dtype == torch.float64 else z.float()


def ce_grad_reference(z, targets, inv_n, ignore_index=-100):
    """Torch version of the row kernel: returns per-row losses and the logit gradient (new tensors); inv_n is a
    0-d tensor."""
    zf = _at_least_fp32(z)
    valid = targets != ignore_index
    t = targets.clamp_min(0)
    lse = torch.logsumexp(zf, dim=-1)
    loss = (lse - zf.gather(1, t[:, None]).squeeze(1)) * valid
    g = torch.exp(zf - lse[:, None])                          # softmax, from the lse we already have
    g = g.scatter_add(1, t[:, None], -torch.ones_like(lse)[:, None])     # - onehot(t), without a [n, V] one-hot
    return loss, g * (valid[:, None] * inv_n.to(zf.dtype))


def _ce_grad_(z, targets, inv_n, ignore_index, backend):
    """Per-row losses; z is overwritten with the logit gradient."""
    if use_triton(z, backend):
        loss = torch.empty(z.shape[0], device=z.device, dtype=compute_dtype(z))
        M, V = z.shape
        R = 1 if z.is_cuda else 16        # rows per program: the interpreter pays per program
        block_v, warps = (min(8192, next_pow2(V)), 16) if z.is_cuda else (min(64, next_pow2(V)), 4)
        _ce_grad_rows[(cdiv(M, R),)](z, targets, loss, inv_n, M, V, z.stride(0), ignore_index, ROWS=R,
                                     BLOCK_V=block_v, ACC=compute_type(z), num_warps=warps)
        return loss
    loss, g = maybe_compiled(ce_grad_reference, backend)(z, targets, inv_n, ignore_index)
    z.copy_(g)
    return loss


def default_chunk(n_tokens, vocab, channels, min_chunk=2048):
    """Tokens per chunk: a chunk's logits about the size of h (Liger-Kernel's heuristic), but at least
    min_chunk tokens, or each chunk's three GEMMs stream the whole [V, C] weight for too little work (16-token
    chunks run ~5x slower than unfused on a CPU; on a GPU a 256-row GEMM against a 50k x 768 weight is bound by
    reading the weight, a 2048-row one by its arithmetic)."""
    return min(n_tokens, max(min_chunk, next_pow2(cdiv(n_tokens, cdiv(vocab, channels)))))


def cdiv(a, b):
    return -(-a // b)


def _chunk_pass(h, weight, targets, inv_n, ignore_index, chunk, backend, dh=None, dw=None):
    """The summed per-row losses, chunk by chunk: z = h_c W^T, the row kernel (z <- the logit gradient), then
    dh_c = z W where dh is given and dW += z^T h_c where dw is given (the same ops in the forward and in a
    deferred dW, so both give the same bits)."""
    loss = torch.zeros((), device=h.device, dtype=_acc_dtype(h))
    for i in range(0, h.shape[0], chunk):
        hc, tc = h[i:i + chunk], targets[i:i + chunk]
        z = hc @ weight.t()                                  # [n, V]: the only vocab-sized buffer
        loss += _ce_grad_(z, tc, inv_n, ignore_index, backend).sum()
        if dh is not None:
            torch.mm(z, weight, out=dh[i:i + chunk])
        if dw is not None:
            _accumulate(dw, z.t(), hc)
    return loss


MIXED_DTYPE_GEMM = ("cuda",)        # devices whose addmm takes 16-bit operands into an fp32 output (out_dtype)


def _accumulate(acc, a, b):
    """acc += a @ b in acc's dtype (>= fp32) by one GEMM, in place: no [V, C] temporary per chunk."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.device.type in MIXED_DTYPE_GEMM:
        # bf16/fp16 operands, fp32 output: cuBLAS adds into the fp32 buffer (C = AB + C, out being self as in
        # addmm_). CUDA takes a self of out_dtype since pytorch/pytorch#167931 (Nov 2025; before, self had to be
        # the operands' dtype); the rules it checks are checked on CPU (tests/test_kernels.py)
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:                                # CPU has no mixed-dtype GEMM (16-bit on CPU is a test path only)
        acc += (a @ b).to(acc.dtype)


def _acc_dtype(h):
    return torch.float64 if h.dtype == torch.float64 else torch.float32    # sums over chunks: >= fp32


def _weight_grad(h, weight, targets, inv_n, ignore_index, chunk, backend, grad_loss):
    """dW of the loss, scaled by grad_loss, as the forward would have computed it (a second pass over the chunks:
    the logits again, their gradient, z^T h_c)."""
    dw = torch.zeros(weight.shape, device=h.device, dtype=_acc_dtype(h))
    _chunk_pass(h, weight, targets, inv_n, ignore_index, chunk, backend, dw=dw)
    dw = dw.to(weight.dtype)
    return dw.mul_(grad_loss.to(dw.dtype))


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index, chunk, backend, defer=None):
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        # 1 / (number of counted targets) as a float64 device scalar: int() of the count would make the host wait
        # for the GPU on every micro-step
        inv_n = (targets != ignore_index).sum().clamp_min(1).double().reciprocal()
        dh = torch.empty_like(h) if need_grad else None
        dw = torch.zeros(weight.shape, device=h.device, dtype=_acc_dtype(h)) if need_grad and not defer else None
        loss = _chunk_pass(h, weight, targets, inv_n, ignore_index, chunk, backend, dh, dw)
        ctx.defer, ctx.args = defer, (ignore_index, chunk, backend)
        ctx.reads = [defer[1]] if defer and weight is defer[1] else []   # W reads the parameter itself (no cast)
        if need_grad and defer:          # W computes dW: keep what it needs to compute the logits again
            ctx.save_for_backward(dh, h, weight, targets, inv_n)
        else:
            ctx.save_for_backward(dh, dw.to(weight.dtype) if need_grad else None)
        return loss * inv_n.to(loss.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        # scaled in place: no second vocab x C buffer (so this graph can be backpropagated only once)
        if ctx.defer:
            dh, h, weight, targets, inv_n = ctx.saved_tensors
            store, param = ctx.defer
            dw = functools.partial(_weight_grad, h, weight, targets, inv_n, *ctx.args, grad_loss)
            store.defer(lambda: [(param, dw())], reads=ctx.reads)   # (ZeRO-3 keeps its unit gathered until W)
            return dh.mul_(grad_loss.to(dh.dtype)), None, None, None, None, None, None
        dh, dw = ctx.saved_tensors
        return dh.mul_(grad_loss.to(dh.dtype)), dw.mul_(grad_loss.to(dw.dtype)), None, None, None, None, None


def linear_cross_entropy_reference(h, weight, targets, ignore_index=-100):
    """The definition: full logits, then F.cross_entropy in fp32 (as model.py's LMHead)."""
    return F.cross_entropy(_at_least_fp32(h @ weight.t()), targets, ignore_index=ignore_index)


def linear_cross_entropy(h, weight, targets, ignore_index=-100, chunk=None, backend="auto", defer=None):
    """mean over tokens of cross_entropy(h @ weight^T, targets), never materialising all the logits.
    h [..., C], targets [...]; backend 'torch' / 'compile' chunk the same way with torch ops per chunk.
    defer: (store, parameter) under a zero-bubble pipeline: the forward computes no dW; backward hands the store
    (pipeline/weight_grads.WeightGradStore) a function that computes it, for the parameter, in W."""
    h2, t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    chunk = chunk or default_chunk(h2.shape[0], weight.shape[0], weight.shape[1])
    backend = "triton" if use_triton(h2, backend) else ("torch" if backend == "auto" else backend)
    return LinearCrossEntropyFunction.apply(h2.contiguous(), weight, t.contiguous(), ignore_index, chunk, backend,
                                            defer)
