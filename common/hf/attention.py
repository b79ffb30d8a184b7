"""
common/hf/attention.py: a drop-in attention core (train_cp.ContextParallelAttentionCore, or any module called as
core(q, k, v, attn_mask=, dropout_p=, is_causal=, scale=) like F.scaled_dot_product_attention) as a function of
Hugging Face transformers' attention registry, where a model's attention is a function chosen by name, not a
module to swap (docs/copy_out.md). Torch only: transformers is the caller's.

    from transformers import AttentionInterface
    AttentionInterface.register("context_parallel", attention_function(core, positions=pos))   # pos: my tokens
    model.set_attn_implementation("context_parallel")     # every layer's attention now calls the core

transformers builds no mask for an implementation its mask registry lacks, so None reaches the core, which is causal
by itself; a mask, dropout or a non-causal module reaches it too and is refused there, never dropped.
"""
import torch


def attention_function(core, positions=None):
    """fn(module, query, key, value, attention_mask, scaling=, dropout=, position_ids=, ...) with q/k/v
    [B, H, T, D] -> (core's output as [B, T, H, D], None), transformers' registry signature. positions: this
    rank's global positions (context parallelism: train_cp.local_positions), against which the first call's
    position_ids are checked: left to the model they would be 0..T-1 of the chunk, silently wrong for RoPE."""
    checked = []

    def attend(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
        pos = kwargs.get("position_ids")
        if not checked and positions is not None:          # once: a host sync, not one per layer and step
            if pos is None or not torch.equal(pos.reshape(-1, pos.shape[-1])[0].cpu(), positions.cpu()):
                raise ValueError(f"context parallelism: position_ids must be this rank's global positions "
                                 f"{positions.tolist()}, got {None if pos is None else pos.reshape(-1).tolist()}")
            checked.append(True)
        out = core(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                   is_causal=getattr(module, "is_causal", True), scale=scaling)
        return out.transpose(1, 2), None
    return attend
