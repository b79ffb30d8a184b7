"""
common/checkpoint/compat.py: whether a checkpoint can be resumed by this run, checked once for every script and layout
(checkpoint.load calls it on every rank). What defines the model must match the checkpoint; how it is trained may
change:

    must match      vocab_size (the dataset's), n_layer, n_head, n_embd, block_size, rope_base; and with experts
                    n_experts, top_k, moe_every. The checkpoint's entries and the model's are the same set, and
                    AdamW's moments go to parameters by the names the checkpoint stores, never by position. The
                    corpus, by content and weight (common/run_identity.py; its path may change).
    may change      RESUMABLE below: batch, lr schedule, layout and world size, dtype, dropout, recompute...

A damaged value (inf/NaN in a weight or a moment) is found here, on load, naming the tensor.
"""
from dataclasses import asdict

import torch

from common.run_identity import corpus_difference, corpus_of

MODEL_FIELDS = ("vocab_size", "n_layer", "n_head", "n_embd", "block_size", "rope_base",
                # the Llama family's (model.GPTConfig; a checkpoint saved before them is model.py's GPT-2 defaults)
                "rope_scaling", "norm", "norm_eps", "mlp", "ffn_hidden", "n_kv_head", "qkv_bias", "bias", "tied")
MOE_FIELDS = ("n_experts", "top_k", "moe_every", "router_renorm")   # compared when either model has experts
RESUMABLE = ("the batch (--global_batch_size, --micro_batch_size), the lr schedule (--lr, --min_lr, --warmup_steps, "
             "--max_steps, --weight_decay, --grad_clip), the layout (world size, --dp --tp --cp --pp --ep, "
             "--zero_stage, --pp_schedule), --dtype, --dropout, --recompute, --kernels, --fp8, --capacity_factor, "
             "--aux_loss_coef")


def saved_model_config(state):
    """The model fields a checkpoint was saved with: its model_config, or (earlier versions) its run config,
    with the vocabulary from its embedding."""
    if isinstance(state.get("model_config"), dict):
        return state["model_config"]
    saved = {k: v for k, v in (state.get("config") or {}).items() if k in MODEL_FIELDS + MOE_FIELDS}
    wte = state["model"].get("transformer.wte.weight")
    if wte is not None:
        saved["vocab_size"] = wte.shape[0]
    return saved


def model_differences(saved, gcfg):
    """["n_head 2 (checkpoint) vs 4 (now)", ...] for every model-defining field that differs."""
    now = asdict(gcfg)
    names = MODEL_FIELDS + (MOE_FIELDS if saved.get("n_experts", 0) or now["n_experts"] else ())
    return [f"{'vocab_size (dataset)' if n == 'vocab_size' else '--' + n} {saved[n]} in the checkpoint vs {now[n]} in this run"
            for n in names if n in saved and saved[n] != now[n]]


def listing(names):
    return f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"


def compatibility_problem(state, path, gcfg, cfg, order, keys):
    """Why this run cannot continue `state` (None if it can): another model (its defining fields, its entries,
    the optimizer state's parameter names), or a step past this run's schedule."""
    if not isinstance(state.get("optimizer"), dict) or not isinstance(state.get("step"), int):
        return f"--resume: {path} is not a training checkpoint (no optimizer state or step in it)"
    differ = model_differences(saved_model_config(state), gcfg)
    if differ:
        return (f"--resume: {path} does not match this model: {'; '.join(differ)}. These define the model and "
                f"must match the checkpoint; on resume you may change {RESUMABLE}")
    extra, missing = sorted(set(state["model"]) - set(keys)), sorted(set(keys) - set(state["model"]))
    names = state["optimizer"].get("names", order)
    foreign = sorted(set(names) - set(order))
    if extra or missing or foreign or len(names) != len(set(names)):
        return (f"--resume: {path} does not match this model: " + "; ".join(
            f"{what} {listing(found)}" for what, found in (("it has", extra), ("it lacks", missing),
                                                            ("its optimizer state names", foreign)) if found)
            + " (entries named alike in the checkpoint and the model are the only ones loaded)")
    corpus = corpus_difference(state["corpus"], corpus_of(cfg)) if "corpus" in state else None   # (older: none)
    if corpus is not None:
        return (f"--resume: {path}: {corpus}. Resume with the corpus it was trained on (--data_dir / --data_mix), or "
                f"start the other run in a new --out_dir")
    last = cfg.stop_step or cfg.max_steps
    if state["step"] > last:
        flag = "--stop_step" if cfg.stop_step else "--max_steps"
        return (f"--resume: {path} is at step {state['step']}, past {flag} {last}: raise {flag} to continue "
                f"(the lr schedule follows --max_steps)")
    return None


def rank_problem(state, path, shapes, moments):
    """Why this rank cannot take its part (None if it can): a shape it holds differs, a parameter has no AdamW
    state, or a value it takes holds inf/NaN (found now, not three skipped steps later)."""
    for name, shape in shapes:
        value = state["model"][name]
        if tuple(value.shape) != shape:
            return f"--resume: {path} does not match this model: {name} {tuple(value.shape)} vs {shape}"
        tensors = [("", value)]
        if name in moments:
            if moments[name] is None:
                return f"--resume: {path} lacks the optimizer state of {name} (a damaged checkpoint)"
            tensors += [(f" ({k})", moments[name][k]) for k in ("exp_avg", "exp_avg_sq")]
        for what, t in tensors:
            if t.is_floating_point() and not torch.isfinite(t).all():
                return (f"--resume: {path} holds inf/NaN in {name}{what}; resume an earlier checkpoint (move this "
                        f"step directory away) or start afresh")
    return None


def model_config(gcfg):
    """What defines the model, saved with it: a resume compares it (compatibility_problem)."""
    return {k: v for k, v in asdict(gcfg).items() if k in MODEL_FIELDS + MOE_FIELDS}
