"""The Llama family and transformers (common/hf/llama.py): a LlamaForCausalLM, Qwen2ForCausalLM or MixtralForCausalLM
built here from a small config (GQA, rope_theta 500000, untied, Llama 3's rotary scaling, Qwen2's q/k/v biases,
Mixtral's top-2 of SwiGLU experts) converted to model.py gives transformers' logits to 1e-12 in float64, its loss, and
its greedy tokens; converting back is bitwise. Every model is built here, offline."""
import math
import os

import pytest
import torch
import transformers

from common.checkpoint.files import latest_checkpoint, load_checkpoint
from distributed_helper import run_workers
from common.hf import interop, llama
from model import GPT, GPTConfig
from train_helpers import EXACT, assert_exact, curves, run_single, text_argv

transformers.logging.set_verbosity_error()
SHAPE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
CASES = dict(
    llama_gqa_llama3_untied=(transformers.LlamaConfig, dict(num_key_value_heads=2, intermediate_size=48,
                                                            rope_parameters=LLAMA3, tie_word_embeddings=False)),
    llama_mqa_tied_biases=(transformers.LlamaConfig, dict(num_key_value_heads=1, intermediate_size=40, rms_norm_eps=1e-5,
                                                          attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    qwen2_biases=(transformers.Qwen2Config, dict(num_key_value_heads=2, intermediate_size=40, tie_word_embeddings=True,
                                                 rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    mixtral_top2=(transformers.MixtralConfig, dict(num_key_value_heads=2, intermediate_size=24, num_local_experts=4,
                                                   num_experts_per_tok=2, tie_word_embeddings=False)),
)


def float64_throughout(hf):
    """transformers rounds to float32 in its RMSNorm, rotary table and Mixtral's router softmax whatever the model's
    dtype: 1e-7 noise that would hide a 1e-12 comparison. The same formulas in float64 (the rotary frequencies as
    transformers' _compute_llama3_parameters writes them)."""
    cfg = hf.config
    rope, D = cfg.rope_parameters, cfg.hidden_size // cfg.num_attention_heads
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    if rope["rope_type"] == "llama3":
        old, low, high, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                                  rope["high_freq_factor"], rope["factor"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv_freq = torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)

    def rotary(x, position_ids):
        angles = position_ids[..., None].double() * inv_freq
        both = torch.cat([angles, angles], dim=-1)
        return both.cos().to(x.dtype), both.sin().to(x.dtype)
    hf.model.rotary_emb.forward = rotary
    for m in hf.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = lambda x, m=m: m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon))
        if type(m).__name__ == "MixtralTopKRouter":
            def route(x, m=m):
                logits = torch.nn.functional.linear(x.reshape(-1, m.hidden_dim), m.weight)
                top, index = torch.topk(logits.softmax(-1), m.top_k, dim=-1)
                return logits, top / top.sum(-1, keepdim=True), index
            m.forward = route
    return hf


def build(case, **changes):
    config_class, fields = CASES[case]
    torch.manual_seed(0)
    hf = config_class(**{**SHAPE, **changes}, **fields)
    model = transformers.AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa", experts_implementation="eager").double().eval()
    with torch.no_grad():                    # biases are zeros at init: make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    return float64_throughout(model)


def model_py_of(hf, state):
    """model.py's GPT with the weights `state` that hf saved, its GPTConfig from config.json (llama.model_fields)."""
    config = hf.config.to_dict()
    assert llama.architecture_problem(config) is None
    fields = {k: v for k, (v, _) in llama.model_fields(config).items()}
    mc = dict(vocab_size=config["vocab_size"], block_size=64, n_layer=2, n_head=4, n_embd=32, norm="rmsnorm",
              mlp="swiglu", router_renorm=config["model_type"] == "mixtral", **fields)
    gcfg = GPTConfig(**mc)
    model = GPT(gcfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(llama.from_hf_pieces(name, [state[n] for n in llama.hf_names(name, mc)], mc))
    return model, mc


@pytest.mark.parametrize("case", CASES)
def test_model_py_gives_transformers_logits_loss_and_greedy_tokens(case, tmp_path):
    """Through the files transformers writes (save_pretrained: Mixtral's experts one by one, as published)."""
    from safetensors.torch import load_file
    hf = build(case)
    hf.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    model, mc = model_py_of(hf, state)
    idx = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, loss = model(idx[:, :-1], idx[:, 1:])
        out = hf(idx[:, :-1])
        shifted = hf(idx, labels=idx).loss             # transformers shifts the labels itself
    torch.testing.assert_close(ours, out.logits, rtol=0, atol=1e-12)
    # transformers' loss_function casts the logits to float32 (whatever the model's dtype): its loss to 1e-6, and the
    # same cross-entropy of its float64 logits to 1e-12
    theirs = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), idx[:, 1:].flatten())
    assert abs(loss.item() - theirs.item()) <= 1e-12 * theirs.item()
    assert abs(loss.item() - shifted.item()) <= 1e-6 * shifted.item()
    prompt = idx[:1, :8]
    greedy = hf.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    mine = prompt
    for _ in range(16):
        mine = torch.cat([mine, model(mine)[0][:, -1:].argmax(-1)], dim=1)
    assert torch.equal(greedy, mine)
    # back to transformers' names, bitwise
    back = {n: t for name, p in model.named_parameters() for n, t in llama.to_hf_pieces(name, p.detach(), mc)}
    assert set(back) == {n for n in state if not (n == "lm_head.weight" and mc["tied"])}
    assert all(torch.equal(back[n], state[n]) for n in back)
    assert llama.model_type_of(mc) == hf.config.model_type and llama.export_problem(mc) is None


@pytest.mark.parametrize("field,value", [("sliding_window", 16), ("rope_parameters", dict(rope_type="yarn", factor=2.0,
                                          rope_theta=1e4)), ("head_dim", 16), ("hidden_act", "gelu")])
def test_what_model_py_cannot_represent_is_named(field, value):
    config = transformers.MistralConfig(**SHAPE).to_dict() if field == "sliding_window" else \
        transformers.LlamaConfig(**SHAPE).to_dict()
    config.update({field: value}, model_type="mixtral" if field == "sliding_window" else "llama")
    problem = llama.architecture_problem(config)
    assert problem is not None and problem[0].split(".")[0] == field.split(".")[0].replace("rope_parameters",
                                                                                             "rope_parameters")


# the flags that give each case's model (checked against its config.json by --init_from)
FLAGS = dict(llama_gqa_llama3_untied=dict(arch="llama", n_kv_head=2, ffn_hidden=48, tied=False, rope_base=500000.0,
                                          rope_scaling="8,1,4,16", norm_eps=1e-6),
             mixtral_top2=dict(arch="mixtral", n_kv_head=2, ffn_hidden=24, n_experts=4, top_k=2, tied=False,
                               rope_base=1e6, norm_eps=1e-5))


@pytest.mark.parametrize("case", sorted(FLAGS))
def test_init_from_gives_transformers_loss_and_exports_back(case, text_data, tmp_path):
    """--init_from a saved transformers model: train_single's step-0 loss is the cross-entropy of transformers'
    float64 logits on batch 0; three steps later, python -m common.hf export writes the same class, which
    transformers loads and whose logits are the checkpoint's to 1e-12, its files the checkpoint's bitwise."""
    from safetensors.torch import load_file
    from common.data import GlobalBatchLoader
    theirs, hf_dir, out, exported = build(case, vocab_size=256), str(tmp_path / "hf"), str(tmp_path / "run"), \
        str(tmp_path / "exported")
    theirs.save_pretrained(hf_dir)
    run_single(text_argv(text_data, out, max_steps=3, micro_batch_size=8, init_from=hf_dir, **FLAGS[case]))
    x, y = GlobalBatchLoader(text_data, 32, 8, seed=1).micro_batch(0, 0, 8)
    with torch.no_grad():
        loss = float(torch.nn.functional.cross_entropy(theirs(x).logits.flatten(0, 1), y.flatten()))
    assert abs(curves(out)[0][0] - loss) <= 1e-12 * loss
    interop.main(["export", out, exported, "--no_tokenizer"])
    state = load_checkpoint(latest_checkpoint(out))
    mc = state["model_config"]
    ours = GPT(GPTConfig(**mc)).double().eval()
    ours.load_state_dict(state["model"], strict=False)
    back = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float64, attn_implementation="sdpa",
                                                             experts_implementation="eager").eval()
    assert type(back).__name__ == type(theirs).__name__
    with torch.no_grad():
        torch.testing.assert_close(float64_throughout(back)(x).logits, ours(x)[0], rtol=0, atol=1e-12)
    files = load_file(os.path.join(exported, "model.safetensors"))
    for name, p in ours.named_parameters():
        assert torch.equal(llama.from_hf_pieces(name, [files[n] for n in llama.hf_names(name, mc)], mc), p), name


def _main(rank, world, script, argv):
    import importlib
    importlib.import_module(script).main(argv)


@pytest.fixture(scope="module")
def llama_import(text_data, tmp_path_factory):
    """A saved LlamaForCausalLM (GQA 2 of 4 heads, Llama 3's rotary scaling, untied) and train_single's 4 float64
    steps from it: (the run's flags, its (losses, grad norms))."""
    root = tmp_path_factory.mktemp("llama_import")
    hf_dir, out = str(root / "hf"), str(root / "single")
    build("llama_gqa_llama3_untied", vocab_size=256).save_pretrained(hf_dir)
    flags = dict(max_steps=4, init_from=hf_dir, **FLAGS["llama_gqa_llama3_untied"])
    run_single(text_argv(text_data, out, micro_batch_size=8, **flags))
    return flags, curves(out)


@pytest.mark.parametrize("script, world, layout", [("train_5d", 4, dict(tp=2, pp=2, sp=True, micro_batch_size=4)),
                                                   ("train_zero", 2, dict(zero_stage=3, micro_batch_size=4))],
                         ids=["tp2-pp2-sp", "zero3"])
def test_an_imported_llama_trains_in_any_layout_as_in_train_single(llama_import, text_data, tmp_path, script, world,
                                                                   layout):
    """Each rank takes its part of the imported weights (TP: the 2 key/value heads one per rank with their query
    heads, the untied head's vocabulary rows; PP: its stages; ZeRO-3: its shards) and trains as train_single does,
    1e-9 per step (loss and grad norm)."""
    flags, ref = llama_import
    out = str(tmp_path / "run")
    run_workers(_main, world, args=(script, text_argv(text_data, out, **flags, **layout)))
    assert_exact(ref, curves(out), EXACT)
