"""Hugging Face export and import (common/hf/interop.py, docs/huggingface.md), checked against transformers'
GPTNeoXForCausalLM in float64: an export's logits equal model.py's to 1e-12 and its 32 greedy tokens are the same
(a train_single run, a (tp 2, pp 2) run, a ZeRO-3 run); an imported random GPTNeoXForCausalLM gives train_single's
step-0 loss to 1e-12 and trains in (dp 2, tp 2) and ZeRO-3 as train_single does (1e-9 per step); export then
import, and import then export, are bitwise; the tokenizers give the trained ids through AutoTokenizer; every
refused config is one line. Every model and tokenizer is built here, offline."""
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers

from common.hf import interop as hf
from common.checkpoint import ModuleState, replicated, save, start_from
from common.checkpoint.files import latest_checkpoint, load_latest
from common import evaluation
from common.config import parse_config
from common.hf.tokenizer import RANKS_FILE, read_ranks
from common.optim import configure_optimizer
from distributed_helper import run_workers
from model import GPT, GPTConfig
from test_failures import one_error_line
from train_helpers import EXACT, assert_exact, curves, make_tiny_dataset, run_single, text_argv, tiny_argv

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK, PROMPT, NEW = 48, 8, 32          # a prompt and its 32 greedy tokens fit the block (no context cropped)


def _main(rank, world, script, argv):
    import importlib
    importlib.import_module(script).main(argv)


def checkpoint_model(out_dir):
    """model.py's GPT in float64 with OUT_DIR's latest checkpoint."""
    state, _ = load_latest(out_dir)
    model = GPT(GPTConfig(**state["model_config"])).double().eval()
    model.load_state_dict(state["model"])
    return model


def float64_rotary(model):
    """transformers computes its rotary table in float32 whatever the model's dtype (GPTNeoXRotaryEmbedding.forward
    calls .float()): 1e-7 noise that would hide a 1e-12 comparison. Replace it with the same formula in float64."""
    cfg = model.config
    head_dim, base = cfg.hidden_size // cfg.num_attention_heads, cfg.rope_parameters["rope_theta"]

    def forward(x, position_ids):
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = position_ids[..., None].double() * inv_freq
        both = torch.cat([angles, angles], dim=-1)
        return both.cos().to(x.dtype), both.sin().to(x.dtype)
    model.gpt_neox.rotary_emb.forward = forward
    return model


def transformers_model(hf_dir, exact_rotary=True):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    assert type(model).__name__ == "GPTNeoXForCausalLM"
    return float64_rotary(model) if exact_rotary else model


def relative(a, b):
    return float((a - b).abs().max() / a.abs().max())


@torch.no_grad()
def assert_same_predictions(ours, theirs, vocab_size):
    """Logits on random ids to 1e-12 relative; 32 greedy tokens identical (transformers' generate, KV cache)."""
    ids = torch.randint(0, vocab_size, (2, BLOCK), generator=torch.Generator().manual_seed(0))
    expected = ours(ids)[0]
    assert relative(expected, theirs(ids).logits) <= 1e-12
    tokens = ids[:, :PROMPT]
    for _ in range(NEW):
        tokens = torch.cat([tokens, ours(tokens)[0][:, -1, :vocab_size].argmax(-1, keepdim=True)], dim=1)
    generated = theirs.generate(ids[:, :PROMPT], attention_mask=torch.ones_like(ids[:, :PROMPT]), do_sample=False,
                                max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0)
    assert torch.equal(generated, tokens)


# ----------------------------------------------------------------------------------------------------------
# export: model.py's logits and greedy tokens through transformers

RUNS = {"single": ("train_single", 1, dict(micro_batch_size=8)),
        "tp2-pp2": ("train_5d", 4, dict(tp=2, pp=2, micro_batch_size=2)),
        "zero3": ("train_zero", 2, dict(zero_stage=3))}


@pytest.fixture(scope="module")
def trained(text_data, tmp_path_factory):
    """trained(layout) -> OUT_DIR of a 3-step float64 run on real text in that layout (run once per module)."""
    cache = {}

    def run(layout):
        if layout not in cache:
            script, world, flags = RUNS[layout]
            out = str(tmp_path_factory.mktemp(f"trained_{layout}") / "run")
            argv = text_argv(text_data, out, max_steps=3, block_size=BLOCK, **flags)
            if world == 1:
                run_single(argv)
            else:
                run_workers(_main, world, args=(script, argv))
            cache[layout] = out
        return cache[layout]
    return run


@pytest.mark.parametrize("layout", sorted(RUNS))
def test_export_gives_model_pys_logits_and_greedy_tokens(trained, tmp_path, layout):
    out, hf_dir = trained(layout), str(tmp_path / "hf")
    hf.main(["export", out, hf_dir])
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert (config["rotary_pct"], config["use_parallel_residual"], config["tie_word_embeddings"],
            config["hidden_act"], config["torch_dtype"]) == (1.0, False, True, "gelu", "float64")
    ours = checkpoint_model(out)
    assert_same_predictions(ours, transformers_model(hf_dir), 256)
    # transformers' own float32 rotary table: the only difference left, far below a layout bug's
    ids = torch.randint(0, 256, (2, BLOCK), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert relative(ours(ids)[0], transformers_model(hf_dir, exact_rotary=False)(ids).logits) < 1e-5


def test_a_missing_rotary_permutation_loads_but_gives_a_worse_finite_loss(text_data, tmp_path, monkeypatch):
    """Why the permutation is tested and not trusted: without it a model that learned to use positions (200 fp32
    steps here) loads and runs, and its loss is finite but clearly worse."""
    from common.hf import convert as hf_convert
    out = str(tmp_path / "run")
    run_single(tiny_argv(text_data, out, max_steps=200, block_size=BLOCK, lr=1e-2, warmup_steps=10))
    hf.main(["export", out, str(tmp_path / "right")])

    def fusion_only(t, n_head):       # per-head [q k v], but the pairs left interleaved
        return t.unflatten(0, (3, n_head, -1)).transpose(0, 1).flatten(0, 2).contiguous()
    monkeypatch.setattr(hf_convert, "qkv_to_neox", fusion_only)
    hf.main(["export", out, str(tmp_path / "wrong")])
    ids = torch.from_numpy(np.fromfile(os.path.join(text_data, "val.bin"), dtype=np.uint16)[:16 * BLOCK + 1]
                           .astype(np.int64))
    x, y = ids[:-1].view(16, BLOCK), ids[1:].view(16, BLOCK)
    with torch.no_grad():
        right, wrong = (torch.nn.functional.cross_entropy(transformers_model(str(tmp_path / d))(x).logits.flatten(0, 1),
                                                          y.flatten()) for d in ("right", "wrong"))
    assert torch.isfinite(wrong) and wrong > right + 0.1, (float(right), float(wrong))


# ----------------------------------------------------------------------------------------------------------
# import: a random GPTNeoXForCausalLM trains as model.py does, in any layout

def random_neox(hf_dir, vocab_size=256, **changes):
    """A GPTNeoXForCausalLM with model.py's shape, every parameter random (norms and biases too, so that a wrong
    permutation of a bias or a swapped norm shows), saved in float64."""
    config = transformers.GPTNeoXConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=128, rotary_pct=1.0,
                                        use_parallel_residual=False, tie_word_embeddings=True, hidden_act="gelu",
                                        max_position_embeddings=32, **changes)
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(config).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(hf_dir)
    return hf_dir


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    return random_neox(str(tmp_path_factory.mktemp("neox") / "hf"))


@pytest.fixture(scope="module")
def single_from_neox(neox, text_data, tmp_path_factory):
    """train_single's 10 float64 steps from the random NeoX model: (out_dir, (losses, grad norms))."""
    out = str(tmp_path_factory.mktemp("single_from_neox") / "run")
    run_single(text_argv(text_data, out, micro_batch_size=8, max_steps=10, init_from=neox))
    return out, curves(out)


def test_imported_step_0_loss_is_transformers_loss(neox, single_from_neox, text_data):
    """transformers' loss_function casts logits with .float() (float32 even for a float64 model), so its loss is
    taken from its float64 logits and the run's own batch 0."""
    from common.data import GlobalBatchLoader
    x, y = GlobalBatchLoader(text_data, 32, 8, seed=1).micro_batch(0, 0, 8)
    with torch.no_grad():
        logits = transformers_model(neox)(x).logits
    loss = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
    step0 = single_from_neox[1][0][0]
    assert abs(step0 - loss) <= 1e-12 * loss, (step0, loss)


@pytest.mark.parametrize("script, world, flags", [("train_5d", 4, dict(dp=2, tp=2)),
                                                  ("train_zero", 2, dict(zero_stage=3)),
                                                  ("train_pp", 2, dict(pp=2, micro_batch_size=2))],
                         ids=["dp2-tp2", "zero3", "pp2"])
def test_imported_weights_train_in_any_layout_as_in_train_single(neox, single_from_neox, text_data, tmp_path, script,
                                                                 world, flags):
    out = str(tmp_path / "run")
    run_workers(_main, world, args=(script, text_argv(text_data, out, max_steps=10, init_from=neox, **flags)))
    assert_exact(single_from_neox[1], curves(out), EXACT)


def test_export_then_import_is_bitwise(trained, tmp_path):
    """A checkpoint exported and imported again (the call every train script makes) is the same state_dict."""
    out = trained("single")
    state, _ = load_latest(out)
    hf_dir = str(tmp_path / "hf")
    hf.main(["export", out, hf_dir, "--no_tokenizer"])
    gcfg = GPTConfig(**state["model_config"])
    model = GPT(gcfg).double()
    held = ModuleState([model], configure_optimizer(model.named_parameters(), SimpleNamespace(
        lr=1e-3, weight_decay=0.1)), replicated)
    assert start_from(SimpleNamespace(resume=False, init_from=hf_dir), SimpleNamespace(rank=0, device="cpu"), gcfg,
                      held) == 0
    imported = model.state_dict()
    assert imported.keys() == state["model"].keys()
    for name, value in state["model"].items():
        assert imported[name].dtype == value.dtype and torch.equal(imported[name], value), name
    assert not held.optimizer.state                   # AdamW fresh


def test_import_then_export_is_bitwise(neox, text_data, tmp_path):
    """A NeoX model imported, saved as a checkpoint at step 0 and exported: the same safetensors, tensor for tensor."""
    from safetensors import safe_open
    out = str(tmp_path / "run")
    cfg = parse_config(text_argv(text_data, out, init_from=neox))
    gcfg = GPTConfig(vocab_size=256, block_size=cfg.block_size, n_layer=2, n_head=4, n_embd=32)
    model = GPT(gcfg).double()
    held = ModuleState([model], configure_optimizer(model.named_parameters(), cfg), replicated)
    start_from(cfg, SimpleNamespace(rank=0, device="cpu"), gcfg, held)
    save(cfg, gcfg, 0, held)
    hf.main(["export", out, str(tmp_path / "again")])
    with safe_open(os.path.join(neox, "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "again" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


# ----------------------------------------------------------------------------------------------------------
# tokenizers

def test_the_byte_tokenizer_gives_the_trained_ids(trained, tmp_path):
    """Any text -> its UTF-8 bytes as ids; any ids (invalid UTF-8 too) -> the text the run's samples show."""
    from common.evaluation import decode
    hf_dir = str(tmp_path / "hf")
    hf.main(["export", trained("single"), hf_dir])
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    texts = ["plain ascii", "  two spaces,\ttabs\nand lines \n", "héllo wörld", "日本語のテキスト", "emoji 🙂👍🏽",
             "e\u0301 combining", "\x00\x7f control", "<|endoftext|> is text here"]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids == list(text.encode()), text
        assert tokenizer.decode(ids) == text
    rng = np.random.default_rng(0)
    for n in range(1, 200):
        ids = rng.integers(0, 256, size=n % 17 + 1).tolist()
        assert tokenizer.decode(ids) == decode(ids, dict(tokenizer="byte")) == bytes(ids).decode("utf-8", "replace")
    assert tokenizer.convert_ids_to_tokens([0xff, 0xc3]) != ["\ufffd", "\ufffd"]     # one token per byte, no loss


def train_bpe(text, n_merges, pattern):
    """tiktoken-style ranks: the 256 bytes, then the most frequent new pair inside GPT-2's words, n_merges times."""
    import regex
    words = [[bytes([b]) for b in w.encode()] for w in regex.findall(pattern, text)]
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(n_merges):
        pairs = Counter(p for w in words for p in zip(w, w[1:]))
        a, b = next(p for p, _ in pairs.most_common() if p[0] + p[1] not in ranks)
        ranks[a + b] = len(ranks)
        merged = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged.append(out)
        words = merged
    return ranks


def stdlib_text(name, size):
    import sysconfig
    return open(os.path.join(sysconfig.get_paths()["stdlib"], name), encoding="utf-8").read()[:size]


def test_a_gpt2_bpe_corpus_exports_gpt2_tokenizer_files(tmp_path, monkeypatch, capsys):
    """A GPT-2-style BPE (tiktoken's Encoding of a small merge table trained here, standing in for GPT-2's, which
    tiktoken downloads) prepared by python -m common.data --tokenizer gpt2, which keeps its ranks with the corpus,
    and exported with a run trained on it: AutoTokenizer gives tiktoken's ids and decodes them back. The run's
    sample decodes with the corpus's ranks (tiktoken's GPT-2 file is never fetched)."""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str
    from common import data as prepare
    from common.hf import tokenizer
    ranks = train_bpe(stdlib_text("argparse.py", 20_000), 100, r50k_pat_str)
    enc = tiktoken.Encoding("small", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
    monkeypatch.setattr(tokenizer, "gpt2_encoding", lambda: enc)
    text, data = tmp_path / "text.txt", str(tmp_path / "data")
    text.write_text(stdlib_text("inspect.py", 200_000))
    prepare.main(["--input", str(text), "--tokenizer", "gpt2", "--out_dir", data])
    assert read_ranks(os.path.join(data, RANKS_FILE)) == ranks      # the corpus's own BPE data
    out, hf_dir = str(tmp_path / "run"), str(tmp_path / "hf")
    run_single(tiny_argv(data, out, max_steps=1, block_size=BLOCK, sample_tokens=8))
    assert "---- sample ----\n" in capsys.readouterr().out
    assert evaluation.decode(enc.encode_ordinary("def f(x):\n"), dict(tokenizer="gpt2"), data) == "def f(x):\n"
    hf.main(["export", out, hf_dir])
    assert {"vocab.json", "merges.txt", "tokenizer.json"} <= set(os.listdir(hf_dir))
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for text in [stdlib_text("typing.py", 5_000), "Hello world, it's 2024!\n\n  indented   \t x", "naïve café 🙂 日本",
                 "trailing spaces   ", "'s 're 've 'm 'll 'd numbers 1234567 and __dunder__()"]:
        ids = tokenizer(text)["input_ids"]
        assert ids == enc.encode_ordinary(text), text[:40]
        assert tokenizer.decode(ids) == text == enc.decode(ids)
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == len(ranks) == tokenizer.eos_token_id
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert config["eos_token_id"] == len(ranks) and (config["vocab_size"], config["tokenizer_vocab_size"]) == (384, 357)
    # the padded head: the same logits (all 384 columns, float64 from the run's float32 weights), and generation
    # never picks a padded id (generation_config.json suppresses them, as model.py's sampling leaves them out)
    assert_same_predictions(checkpoint_model(out), transformers_model(hf_dir), 357)


def test_data_with_a_hugging_face_tokenizer_trains_and_exports_it(trained, tmp_path, capsys):
    """python -m common.data --tokenizer HF_DIR: AutoTokenizer's ids, meta.json names the tokenizer, the sample
    decodes with it, and an export carries the same tokenizer.json."""
    from common import data
    from common.hf.tokenizer import byte_tokenizer
    source = str(tmp_path / "tok")
    hf.main(["export", trained("single"), source])     # any tokenizer.json: the byte one
    text = tmp_path / "text.txt"
    text.write_text(stdlib_text("tarfile.py", 60_000) + "\nnaïve 🙂")
    corpus = str(tmp_path / "corpus")
    data.main(["--input", str(text), "--tokenizer", source, "--out_dir", corpus])
    meta = json.load(open(os.path.join(corpus, "meta.json")))
    assert meta["tokenizer"] == "hf" and meta["tokenizer_from"] == os.path.abspath(source)
    ids = np.concatenate([np.fromfile(os.path.join(corpus, f"{s}.bin"), dtype=np.uint16) for s in ("train", "val")])
    expected = transformers.AutoTokenizer.from_pretrained(source)(text.read_text(), add_special_tokens=False)
    assert ids.tolist() == expected["input_ids"] and meta["vocab_size"] == byte_tokenizer().get_vocab_size()
    out, exported = str(tmp_path / "run"), str(tmp_path / "hf")
    run_single(tiny_argv(corpus, out, max_steps=1, sample_tokens=8))
    assert "---- sample ----\n" in capsys.readouterr().out
    hf.main(["export", out, exported])
    assert open(os.path.join(exported, "tokenizer.json"), "rb").read() == \
        open(os.path.join(source, "tokenizer.json"), "rb").read()


# ----------------------------------------------------------------------------------------------------------
# refusals: one line naming the field and its value, before any work

def _rope(key, value):
    return lambda config: config["rope_parameters"].update({key: value})


def _pythia(config):        # Pythia's settings in transformers 4's spelling
    config.pop("rope_parameters")
    config.update(use_parallel_residual=True, rotary_pct=0.25, tie_word_embeddings=False)


REFUSED = [
    (dict(use_parallel_residual=True), "use_parallel_residual true"),
    (_rope("partial_rotary_factor", 0.25), "rope_parameters.partial_rotary_factor 0.25"),
    (_pythia, "use_parallel_residual true"),
    (dict(tie_word_embeddings=False), "tie_word_embeddings false"),
    (dict(num_key_value_heads=2), "num_key_value_heads 2"),
    (dict(hidden_act="gelu_new"), 'hidden_act "gelu_new"'),
    (dict(layer_norm_eps=1e-6), "layer_norm_eps 1e-06"),
    (dict(model_type="phi"), 'model_type "phi"'),
    (dict(num_experts=8), "num_experts 8"),
    (_rope("rope_theta", 500000.0), "rope_parameters.rope_theta 500000.0"),
    (_rope("rope_type", "linear"), 'rope_parameters.rope_type "linear"'),
    (dict(attention_bias=False), "attention_bias false"),
    (dict(intermediate_size=96), "intermediate_size 96"),
    (dict(num_hidden_layers=3), "num_hidden_layers 3 in its config.json vs --n_layer 2"),
]


@pytest.mark.parametrize("edit, message", REFUSED, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(REFUSED)])
def test_a_config_model_py_cannot_represent_is_one_line(neox, text_data, tmp_path, capsys, edit, message):
    hf_dir = str(tmp_path / "hf")
    shutil.copytree(neox, hf_dir)
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    if callable(edit):
        edit(config)
    else:
        config.update(edit)
    json.dump(config, open(os.path.join(hf_dir, "config.json"), "w"))
    line = one_error_line(capsys, text_argv(text_data, str(tmp_path / "run"), init_from=hf_dir))
    assert f"--init_from {hf_dir}: {message}" in line
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def test_other_unusable_inputs_are_one_line(neox, text_data, tmp_path, capsys):
    run = str(tmp_path / "run")

    def argv(source, **flags):
        return text_argv(text_data, run, init_from=source, **flags)
    assert "not a directory" in one_error_line(capsys, argv(str(tmp_path / "nowhere")))
    os.makedirs(tmp_path / "empty")
    assert "no config.json" in one_error_line(capsys, argv(str(tmp_path / "empty")))
    shutil.copy(os.path.join(neox, "config.json"), tmp_path / "empty")
    assert "no model.safetensors" in one_error_line(capsys, argv(str(tmp_path / "empty")))
    assert "--n_experts 4" in one_error_line(capsys, argv(neox, n_experts=4))
    wide = random_neox(str(tmp_path / "wide"), vocab_size=320)
    line = one_error_line(capsys, argv(wide))
    assert "vocab_size 320 in its weights, but this run's embedding has 256 rows" in line
    assert not os.path.exists(os.path.join(run, "metrics.jsonl"))


def test_an_export_that_cannot_be_made_is_one_line(trained, text_data, tmp_path, capsys):
    out = trained("single")
    assert "no checkpoint there" in one_error_line(capsys, ["export", str(tmp_path), str(tmp_path / "hf")], hf)
    assert "is not here" in one_error_line(capsys, ["export", out, str(tmp_path / "hf"), "--data_dir",
                                                    str(tmp_path / "gone")], hf)
    synthetic = make_tiny_dataset(str(tmp_path / "synthetic"), vocab_size=256)
    assert "tokenizer 'synthetic' has no Hugging Face form here" in \
        one_error_line(capsys, ["export", out, str(tmp_path / "hf"), "--data_dir", synthetic], hf)
    moe = str(tmp_path / "moe")
    run_single(tiny_argv(text_data, moe, max_steps=1, n_experts=2, top_k=1))
    assert "n_experts 2: GPTNeoXForCausalLM cannot hold it (GPT-NeoX has no mixture of experts)" in \
        one_error_line(capsys, ["export", moe, str(tmp_path / "hf")], hf)
    assert not os.path.exists(tmp_path / "hf")


def test_training_and_export_never_import_transformers_and_say_what_is_missing(trained, neox, text_data, tmp_path):
    """With transformers unimportable, python -m common.hf export and --init_from work; without safetensors or
    tokenizers, the entry point that needs it says so in one line."""
    script = f"""
import runpy, sys, json
sys.path.insert(0, {ROOT!r}); sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
from train_helpers import tiny_argv
sys.modules["transformers"] = None
def run(argv, module="common.hf", block=()):
    for name in block:
        sys.modules[name] = None
    sys.argv = ["x"] + argv
    try:
        runpy.run_module(module, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    for name in block:
        del sys.modules[name]
    return code
codes = [run(["export", {trained("single")!r}, {str(tmp_path / "hf")!r}]),
         run(tiny_argv({text_data!r}, {str(tmp_path / "a")!r}, max_steps=1, n_layer=2, n_head=4, n_embd=32,
                       init_from={neox!r}), "train_single"),
         run(["export", {trained("single")!r}, {str(tmp_path / "hf2")!r}], block=["tokenizers"]),
         run(tiny_argv({text_data!r}, {str(tmp_path / "b")!r}, n_layer=2, n_head=4, n_embd=32, init_from={neox!r}),
             "train_single", block=["safetensors"])]
print(json.dumps(codes))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [0, 0, 2, 2]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "needs the tokenizers package" in errors[0] and "pip install tokenizers" in errors[0]
    assert "--init_from needs the safetensors package" in errors[1] and "safetensors==0.8.0" in errors[1]
    assert "Traceback" not in result.stderr


# ----------------------------------------------------------------------------------------------------------
# what an import reads and an export writes: every tensor used, finite, in range; an export all or nothing

def edited_neox(neox, hf_dir, edit):
    """A copy of the NeoX directory whose tensors `edit` ({name: tensor}) changed in place."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(neox, hf_dir)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    return hf_dir


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update({"embed_out.weight": t["gpt_neox.embed_in.weight"] + 1}),
     "its weights hold embed_out.weight, which this run's model has no place for"),
    (lambda t: t.update({k.replace("layers.1.", "layers.2."): v.clone() for k, v in list(t.items())
                         if "layers.1." in k}),
     "its weights hold gpt_neox.layers.2.attention.dense.bias and 11 more, which"),
    (lambda t: t["gpt_neox.layers.1.mlp.dense_4h_to_h.weight"].view(-1).__setitem__(7, float("nan")),
     "gpt_neox.layers.1.mlp.dense_4h_to_h.weight (model.py's transformer.h.1.mlp.c_proj.weight) holds inf/NaN"),
    (lambda t: t["gpt_neox.final_layer_norm.bias"].__setitem__(0, float("-inf")), "final_layer_norm.bias (model"),
])
def test_init_from_uses_every_tensor_and_only_finite_ones(neox, text_data, tmp_path, capsys, edit, message):
    """Before, an extra layer or an untied head was dropped without a word, and a NaN weight started the run (its
    steps then skipped as non-finite until the run stopped)."""
    hf_dir = edited_neox(neox, str(tmp_path / "hf"), edit)
    line = one_error_line(capsys, text_argv(text_data, str(tmp_path / "run"), init_from=hf_dir))
    assert line.startswith(f"error: --init_from {hf_dir}: ") and message in line, line
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def test_init_from_takes_buffers_older_transformers_saved(neox, text_data, tmp_path):
    hf_dir = edited_neox(neox, str(tmp_path / "hf"), lambda t: t.update({
        "gpt_neox.layers.0.attention.rotary_emb.inv_freq": torch.ones(4),
        "gpt_neox.layers.0.attention.bias": torch.ones(4, dtype=torch.bool)}))
    assert hf.unused_tensors(hf.weight_files(hf_dir), GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_embd=32)) == []
    assert parse_config(text_argv(text_data, str(tmp_path / "run"), init_from=hf_dir)).init_from == hf_dir


def test_a_16_bit_export_refuses_values_beyond_its_range(trained, tmp_path, capsys):
    """1e6 in one weight: float16 (largest 65504) would write inf there; bfloat16 holds it."""
    out = str(tmp_path / "run")
    shutil.copytree(trained("single"), out)
    path = latest_checkpoint(out)
    state = torch.load(path, weights_only=False)
    state["model"]["transformer.h.1.attn.c_proj.weight"][3, 5] = -1e6
    torch.save(state, path)
    line = one_error_line(capsys, ["export", out, str(tmp_path / "hf"), "--dtype", "float16"], hf)
    assert line == (f"error: {path}: transformer.h.1.attn.c_proj.weight holds 1e+06, beyond float16's largest 65504: "
                    f"exported so it would be inf (export with --dtype float32 or bfloat16)")
    assert not os.path.exists(tmp_path / "hf")
    hf.main(["export", out, str(tmp_path / "hf"), "--dtype", "bfloat16", "--no_tokenizer"])


def raising(exc):
    def write(*args):
        raise exc
    return write


def export_files(hf_dir):
    return {name: open(os.path.join(hf_dir, name), "rb").read() for name in sorted(os.listdir(hf_dir))}


def test_an_export_is_all_or_nothing(trained, tmp_path, capsys, monkeypatch):
    """A full disk (or Ctrl-C) half-way through an export over an earlier one leaves the earlier one, byte for
    byte, and no temporary directory; a killed export's directory is removed by the next; an export without the
    tokenizer over one with it leaves no tokenizer of the other behind; a directory holding other files is refused
    (replacing it would delete them)."""
    import errno
    out, hf_dir = trained("single"), str(tmp_path / "hf")
    hf.main(["export", out, hf_dir])
    before = export_files(hf_dir)
    assert "tokenizer.json" in before
    real = hf.write_safetensors

    def full_disk(path, *args):
        open(path, "wb").write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    for failure, ends in ((full_disk, SystemExit), (raising(KeyboardInterrupt()), KeyboardInterrupt)):
        monkeypatch.setattr(hf, "write_safetensors", failure)
        with pytest.raises(ends):
            hf.main(["export", out, hf_dir, "--dtype", "float32"])
        assert export_files(hf_dir) == before and os.listdir(tmp_path) == ["hf"]
    assert capsys.readouterr().err == (f"error: cannot write the export to {hf_dir} (No space left on device); what "
                                       f"was there is kept as it was\n")
    monkeypatch.setattr(hf, "write_safetensors", real)
    os.makedirs(tmp_path / "hf.tmp.99999999")               # a killed export's (no such process)
    hf.main(["export", out, hf_dir, "--no_tokenizer"])
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    assert set(os.listdir(hf_dir)) == {"config.json", "generation_config.json", "model.safetensors"}
    open(os.path.join(hf_dir, "README.md"), "w").write("model card")
    line = one_error_line(capsys, ["export", out, hf_dir], hf)
    assert line == (f"error: HF_DIR {hf_dir} holds README.md, which an export does not write: an export replaces the "
                    f"whole directory, so give a new or empty one, or an earlier export")
    assert "README.md" in os.listdir(hf_dir)


def test_an_export_killed_between_its_renames_keeps_the_earlier_one(trained, tmp_path, monkeypatch):
    out, hf_dir = trained("single"), str(tmp_path / "hf")
    hf.main(["export", out, hf_dir, "--no_tokenizer"])
    before = export_files(hf_dir)
    import errno
    os.rename(hf_dir, tmp_path / "hf.old.99999999")       # the first rename done, then killed
    monkeypatch.setattr(hf, "write_safetensors", raising(OSError(errno.EIO, "Input/output error")))
    with pytest.raises(SystemExit):
        hf.main(["export", out, hf_dir])
    assert export_files(hf_dir) == before and os.listdir(tmp_path) == ["hf"]


def test_a_symlinked_hf_dir(trained, tmp_path, capsys):
    """A link to a directory: the export lands there and the link stays a link; a dangling link: one line."""
    out, target, link = trained("single"), tmp_path / "target", str(tmp_path / "link")
    os.makedirs(target)
    os.symlink(str(target), link)
    hf.main(["export", out, link, "--no_tokenizer"])
    assert os.path.islink(link) and "model.safetensors" in os.listdir(target)
    os.symlink(str(tmp_path / "nowhere"), tmp_path / "dangling")
    line = one_error_line(capsys, ["export", out, str(tmp_path / "dangling")], hf)
    assert line == (f"error: HF_DIR {tmp_path / 'dangling'} is a symbolic link to {tmp_path / 'nowhere'}, which does "
                    f"not exist (remove the link, or create its directory)")
