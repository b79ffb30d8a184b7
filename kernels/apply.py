"""
kernels/apply.py: swap model.py's modules for the fused ones in place, keeping every parameter (same
Parameter objects, so names, init and optimizer groups are unchanged):

    nn.LayerNorm (ln_1, ln_2, ln_f)          -> FusedLayerNorm              (layer_norm)
    nn.RMSNorm (the Llama family's)          -> FusedRMSNorm                (rms_norm)
    gated MLP: silu(gate) * up               -> FusedGatedMLP               (swiglu; experts' too)
    Block's MLP: c_fc bias + GeLU            -> bias_gelu
                 c_proj bias + dropout + x   -> bias_dropout_add            (FusedBlock)
    CausalSelfAttention.core (sdpa)          -> FlashAttentionCore          (flash_attention; triton only:
                                                sdpa already is a fused kernel in torch)
    GPT.lm_head (logits + cross-entropy)     -> FusedLMHead                 (linear_cross_entropy, chunked)

Modes (--kernels): triton (the Triton kernels), compile (the same fusions by torch.compile: each FusedBlock
compiled whole, ln_f and the LM head's row kernel from their compiled torch references: a fused path on CPU),
head (the Triton LM head alone, the rest model.py's: what the fused head gains by itself), torch (model.py
untouched: the reference), auto (= torch, on every device).

Under tensor parallelism (train_tp's layers swapped in first) the same swaps apply where they keep TP's
communication: LayerNorm runs on whatever it is given (replicated, or SP's sequence chunk); FusedBlock takes the
parallel layers' `matmul` (x W^T with their f / g collectives, bias left out), so bias+GeLU runs on the
column-parallel output shard with its bias shard, and bias+dropout+residual after the row-parallel sum; the
attention core runs on this rank's heads. The LM head stays train_tp's VocabParallelLMHead: its cross-entropy is
already vocab-parallel (a number per token all-reduced three times, never [tokens, vocab] logits on one rank),
and the fused head's chunked linear+CE assumes the whole vocabulary on one rank (docs/kernels.md).

Why auto is torch, on GPUs too: auto must pick the path measured fastest, and no Triton kernel here has yet been
timed against torch on a GPU, while torch's own path there is already fused where it matters (sdpa dispatches
to FlashAttention / cuDNN / memory-efficient kernels; cuBLAS GEMMs; --compile fuses the elementwise ops). Once
bench/gpu_check.sh measures a Triton kernel faster, auto can name it. FP8 (convert_to_float8) composes with
every mode: a FusedBlock runs a Float8Linear's FP8 GEMM and only fuses the bias after it.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.backend import HAS_TRITON
from kernels.bias_gelu import bias_dropout_add, bias_gelu
from kernels.flash_attention import flash_attention
from kernels.layer_norm import layer_norm
from kernels.rms_norm import rms_norm
from kernels.swiglu import swiglu
from kernels.linear_cross_entropy import linear_cross_entropy

MODES = ("auto", "triton", "torch", "compile", "head")


def resolve_mode(mode, device):
    """The mode that will run on `device`; ValueError (one clear line) when it cannot."""
    device = torch.device(device)
    if mode not in MODES:
        raise ValueError(f"--kernels must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        return "torch"             # the measured-fastest path until a Triton kernel wins on a GPU (docstring)
    if mode in ("triton", "head") and not HAS_TRITON:
        raise ValueError(f"--kernels {mode} needs triton (pip install triton); use --kernels torch or compile")
    if mode in ("triton", "head") and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"--kernels {mode} on CPU runs only in Triton's interpreter: set TRITON_INTERPRET=1 "
                         "(slow; for testing) or use --kernels compile")
    return mode


class FusedLayerNorm(nn.Module):
    def __init__(self, ln, backend):
        super().__init__()
        self.weight, self.bias, self.eps, self.backend = ln.weight, ln.bias, ln.eps, backend

    def forward(self, x):
        return layer_norm(x, self.weight, self.bias, self.eps, backend=self.backend)


class FusedRMSNorm(nn.Module):
    def __init__(self, norm, backend):
        super().__init__()
        self.weight, self.eps, self.backend = norm.weight, norm.eps, backend

    def forward(self, x):
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps     # nn.RMSNorm's default
        return rms_norm(x, self.weight, eps, backend=self.backend)


class FusedGatedMLP(nn.Module):
    """model.MLP with mlp="swiglu": silu(gate) * up of c_fc's [gate | up] output in one kernel; same children, same
    names. c_fc and c_proj are called as modules (their biases, FP8 GEMMs, tensor-parallel collectives kept)."""

    def __init__(self, mlp, backend):
        super().__init__()
        self.c_fc, self.c_proj, self.dropout, self.backend = mlp.c_fc, mlp.c_proj, mlp.dropout, backend

    def forward(self, x):
        return self.dropout(self.c_proj(swiglu(self.c_fc(x), backend=self.backend)))


class FlashAttentionCore(nn.Module):
    """Causal attention by the Triton kernel; attention dropout is not in the kernel, so a training run with
    dropout > 0 keeps sdpa (said once, at swap time)."""

    def __init__(self, backend):
        super().__init__()
        self.backend = backend

    def forward(self, q, k, v):
        return flash_attention(q, k, v, causal=True, backend=self.backend)[0]


class FusedBlock(nn.Module):
    """model.Block with the MLP's bias+GeLU and bias+dropout+residual fused; same children, same names."""

    def __init__(self, block, backend):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = block.ln_1, block.attn, block.ln_2, block.mlp
        self.backend = backend

    def forward(self, x, rope):
        x = x + self.attn(self.ln_1(x), rope)
        mlp = self.mlp
        h = bias_gelu(matmul_without_bias(mlp.c_fc, self.ln_2(x)), mlp.c_fc.bias, backend=self.backend)
        return bias_dropout_add(matmul_without_bias(mlp.c_proj, h), mlp.c_proj.bias, x, mlp.dropout.p,
                                self.training, backend=self.backend)


def matmul_without_bias(linear, x):
    """x W^T of one of the MLP's Linears, its bias left to the fused kernel after it. Through the module, so a
    later swap of the Linear is honoured: a Float8Linear (convert_to_float8, before or after apply_kernels)
    runs its FP8 GEMMs, a tensor-parallel layer its collectives (and its FP8 GEMMs); any other kind would be
    bypassed silently, so it is refused."""
    if _has_matmul(linear):
        return linear.matmul(x)
    if type(linear) is not nn.Linear:
        raise TypeError(f"FusedBlock fuses the bias of an nn.Linear or Float8Linear, not a {type(linear).__name__} "
                        f"(swap it in before apply_kernels, which then keeps the block unfused)")
    return F.linear(x, linear.weight)


class FusedLMHead(nn.Module):
    """The tied LM head; with targets it returns (None, loss) and never builds the [tokens, vocab] logits."""

    def __init__(self, head, backend):
        super().__init__()
        self.weight, self.backend = head.weight, backend
        self.weight_grad_store = None            # zero-bubble pipelines: dW in W (pipeline/weight_grads.py)

    def forward(self, x, targets=None):
        if targets is None:
            return F.linear(x, self.weight), None
        h, w = x, self.weight
        if torch.is_autocast_enabled(x.device.type):
            # what autocast would do to F.linear, done by hand: the fused function runs outside autocast
            dtype = torch.get_autocast_dtype(x.device.type)
            h, w = h.to(dtype), w.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            defer = None if self.weight_grad_store is None else (self.weight_grad_store, self.weight)
            return None, linear_cross_entropy(h, w, targets, backend=self.backend, defer=defer)


def _has_matmul(linear):
    """A Linear kind that offers x W^T without its bias: Float8Linear, train_tp's column / row-parallel layers."""
    return callable(getattr(linear, "matmul", None)) and hasattr(linear, "bias")


def _plain_mlp(mlp, mlp_class):
    """A dense GeLU MLP with biases, of plain, FP8 or tensor-parallel Linears and a plain dropout (MoE blocks, SwiGLU,
    other Linear kinds, and SP's per-rank dropout streams keep their own forward)."""
    if type(mlp) is not mlp_class or mlp.gated or mlp.c_fc.bias is None:    # the kernels fuse bias + GeLU
        return False
    fusable = [type(lin) is nn.Linear or _has_matmul(lin) for lin in (mlp.c_fc, mlp.c_proj)]
    return all(fusable) and type(mlp.dropout) is nn.Dropout


def apply_kernels(model, mode="auto"):
    """Swap the fused modules into a model.py GPT in place (see the table above); returns the mode used."""
    from model import MLP, AttentionCore, Block, LMHead
    device = next(model.parameters()).device
    mode = resolve_mode(mode, device)
    if mode == "torch":
        return mode
    if mode == "head":
        if type(getattr(model, "lm_head", None)) is LMHead:
            model.lm_head = FusedLMHead(model.lm_head, "triton")
        return mode
    # leaves first (norms, attention cores, gated MLPs), then the blocks that hold them
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.LayerNorm):
                setattr(module, child_name, FusedLayerNorm(child, mode))
            elif isinstance(child, nn.RMSNorm):
                setattr(module, child_name, FusedRMSNorm(child, mode))
            elif type(child) is MLP and child.gated:
                setattr(module, child_name, FusedGatedMLP(child, mode))
            elif isinstance(child, AttentionCore) and mode == "triton":
                if child.dropout > 0 or getattr(module, "q_per_kv", 1) > 1:
                    print(f"kernels: {name}.{child_name} keeps sdpa (attention dropout and grouped-query attention "
                          f"are not in the kernel)")
                else:
                    setattr(module, child_name, FlashAttentionCore(mode))
    # the blocks: a GPT's ModuleList, or a pipeline stage's blocks (pipeline.gpt_stages.StageBlocks, a ModuleDict)
    for blocks in [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))]:
        for key, block in list(blocks._modules.items()):
            if type(block) is not Block or not _plain_mlp(block.mlp, MLP):
                continue
            fused = FusedBlock(block, "torch" if mode == "compile" else mode)
            if mode == "compile":
                # regional compilation: inductor fuses the whole block's torch references (LayerNorms, RoPE,
                # bias+GeLU, bias+residual)
                compile_block(fused)
            setattr(blocks, key, fused)
    if type(getattr(model, "lm_head", None)) is LMHead:   # a stage before the last has none; TP's is vocab-parallel
        model.lm_head = FusedLMHead(model.lm_head, mode)
    return mode


def compile_block(block):
    """Compile one block's forward in place (regional compilation; no _orig_mod. in names) and return it. Its
    forward, not its __call__ as Module.compile() does: hooks on the block (ZeRO-3's gather before its forward,
    free after, the backward hook it puts on the output) stay outside the compiled region and run eagerly, as
    torchtitan compiles each block inside FSDP2's hooks; a block compiled already is left as it is."""
    if "forward" not in vars(block):
        block.forward = torch.compile(block.forward)
    return block
