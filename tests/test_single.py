"""train_single.py: determinism, grad-accumulation and recompute equivalence, exact resume, CLI errors."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train_single
from common import precision
from common.checkpoint import latest_checkpoint, load_checkpoint
from common.metrics import read_metrics
from train_helpers import (MODELS, assert_exact, assert_same_losses, assert_same_weights, losses, run_single,
                           text_argv, tiny_argv)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_same_seed_bit_identical(tiny_data, tmp_path):
    a, wa = run_single(tiny_argv(tiny_data, str(tmp_path / "a"), max_steps=8, dropout=0.1))
    b, wb = run_single(tiny_argv(tiny_data, str(tmp_path / "b"), max_steps=8, dropout=0.1))
    assert a == b
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    c, _ = run_single(tiny_argv(tiny_data, str(tmp_path / "c"), max_steps=8, dropout=0.1, seed=99))
    assert c != a


def test_grad_accumulation_equivalence(tiny_data, tmp_path):
    one, w1 = run_single(tiny_argv(tiny_data, str(tmp_path / "1x8"), global_batch_size=8, micro_batch_size=8))
    four, w4 = run_single(tiny_argv(tiny_data, str(tmp_path / "4x2"), global_batch_size=8, micro_batch_size=2))
    assert_same_losses(one, four)
    assert_same_weights(w1, w4)


def test_float64_reference_crosses_a_spike(text_data, tmp_path):
    """The exactness checks' reference run: float64 everywhere, and its real text has a gradient spike."""
    (loss, norms), weights = run_single(text_argv(text_data, str(tmp_path / "ref"), micro_batch_size=8),
                                         both_curves=True)
    assert all(w.dtype == torch.float64 for w in weights.values())
    jumps = [norms[s] / max(norms[max(0, s - 5):s]) for s in range(3, len(norms))]
    assert max(jumps) > 10, f"no gradient spike in the exactness check's run: grad norms {norms}"
    assert loss[-1] < loss[0] - 1.0


def test_float64_is_float64_throughout(text_data):
    """Nothing in the forward is silently downcast: the RoPE table, logits and loss follow the model's dtype."""
    import model as model_py
    from model import GPT, GPTConfig
    gpt = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=16)).double()
    seen = []
    real = model_py.apply_rope
    model_py.apply_rope = lambda x, rope: (seen.append(rope.dtype), real(x, rope))[1]
    try:
        idx = torch.randint(0, 256, (2, 32))
        logits, loss = gpt(idx, idx)
    finally:
        model_py.apply_rope = real
    assert seen == [torch.float64] and logits.dtype == loss.dtype == torch.float64
    # the rotation angles of a large position are exact in float64 (fp32 angles are off by ~1e-4 there)
    pos = torch.tensor([100_000])
    exact = torch.tensor([[[math.cos(100_000.0), math.sin(100_000.0)]]], dtype=torch.float64)
    assert torch.allclose(model_py.rope_cache(16, pos, param_dtype=torch.float64)[:, :1], exact, rtol=0, atol=1e-12)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_float64_models_cross_a_spike_below_the_noise_floor(text_reference_for, text_data, tmp_path, model):
    """Every model shape the exactness checks use crosses a gradient spike (> 5x), and its float64 reordering
    noise (four micro-batches of 2 vs one of 8) stays below 1e-10 at every step: 10x under the 1e-9 contract
    (measured over 30 steps: 3e-13 for L2, 4e-11 for L8; the checks run the first 22), so a parity failure there is a bug, not chaos amplifying rounding."""
    ref, w_ref = text_reference_for(model)
    jumps = [ref[1][s] / max(ref[1][max(0, s - 5):s]) for s in range(3, len(ref[1]))]
    assert max(jumps) > 5, f"{model}: no gradient spike, grad norms {ref[1]}"
    got, w_got = run_single(text_argv(text_data, str(tmp_path / "4x2"), micro_batch_size=2, **MODELS[model]),
                            both_curves=True)
    assert_exact(ref, got, rtol=1e-10)
    assert_same_weights(w_ref, w_got, rtol=1e-10)


def test_recompute_equivalence(tiny_data, tmp_path):
    """Recomputation changes memory, not math: same losses and gradients, also with dropout (the RNG state
    is replayed when the checkpointed region runs again)."""
    runs = {mode: run_single(tiny_argv(tiny_data, str(tmp_path / mode), max_steps=6, dropout=0.1, recompute=mode))
            for mode in ("none", "selective", "full")}
    ref_losses, ref_weights = runs["none"]
    for mode in ("selective", "full"):
        assert_same_losses(ref_losses, runs[mode][0], rtol=1e-6)
        assert_same_weights(ref_weights, runs[mode][1], rtol=1e-6)


def test_resume_is_exact(tiny_data, tmp_path):
    full, wf = run_single(tiny_argv(tiny_data, str(tmp_path / "full"), dropout=0.1))
    out = str(tmp_path / "split")
    run_single(tiny_argv(tiny_data, out, dropout=0.1, stop_step=10))
    assert len(losses(out)) == 10
    resumed, wr = run_single(tiny_argv(tiny_data, out, dropout=0.1, resume=True))
    assert resumed == full                              # bit-identical, not just close
    assert all(torch.equal(wf[n], wr[n]) for n in wf)
    state = load_checkpoint(latest_checkpoint(out))
    assert not any(k.startswith("_orig_mod.") for k in state["model"]) and state["step"] == 20


def test_a_llama_family_run_builds_its_fields_and_resumes_exactly(tiny_data, tmp_path):
    """--arch qwen2 --n_kv_head 2 --ffn_hidden 48: the checkpoint's model is the family's (RMSNorm, SwiGLU, q/k/v
    biases only, an untied head) and a resume from it is bit-identical."""
    flags = dict(arch="qwen2", n_kv_head=2, ffn_hidden=48, tied=False, max_steps=6)
    full, wf = run_single(tiny_argv(tiny_data, str(tmp_path / "full"), **flags))
    out = str(tmp_path / "split")
    run_single(tiny_argv(tiny_data, out, stop_step=3, **flags))
    resumed, wr = run_single(tiny_argv(tiny_data, out, resume=True, **flags))
    assert resumed == full and all(torch.equal(wf[n], wr[n]) for n in wf)
    mc = load_checkpoint(latest_checkpoint(out))["model_config"]
    assert (mc["norm"], mc["mlp"], mc["n_kv_head"], mc["qkv_bias"], mc["bias"], mc["tied"]) == \
        ("rmsnorm", "swiglu", 2, True, False, False)
    assert wf["lm_head.weight"].shape == (64, 32) and wf["transformer.h.0.mlp.c_fc.weight"].shape == (96, 32)
    assert "transformer.h.0.attn.c_attn.bias" in wf and "transformer.h.0.attn.c_proj.bias" not in wf


def test_metrics_contract(tiny_data, tmp_path):
    run_single(tiny_argv(tiny_data, str(tmp_path), max_steps=3, eval_interval=2))
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2]
    keys = {"step", "loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s", "mfu",
            "peak_mem_bytes", "peak_reserved_bytes", "comm_bytes"}
    assert keys <= set(rows[0])
    assert rows[2]["tokens"] == 3 * 8 * 16 and rows[0]["comm_bytes"] == 0
    assert 0 < rows[0]["mfu"] < 1


@pytest.mark.parametrize("args,message", [
    (["--global_batch_size", "10", "--micro_batch_size", "4"], "not divisible"),
    (["--n_embd", "30", "--n_head", "4"], "not divisible by n_head"),
    (["--recompute", "sometimes"], "invalid choice"),
    (["--data_dir", "/nonexistent/dir"], "no dataset"),
    (["--no_such_flag", "1"], "unrecognized arguments"),
])
def test_bad_config_is_one_clear_error(tiny_data, tmp_path, args, message):
    argv = tiny_argv(tiny_data, str(tmp_path)) + args
    proc = subprocess.run([sys.executable, "train_single.py", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))    # no work started


def test_scripts_start_without_torch_dynamo():
    """torch._dynamo costs seconds to import (a refused run took twice as long with it): only --compile's code and the
    lessons whose collectives are marked eager at import (train_tp, and train_5d built on it) may load it."""
    code = ("import sys, train_single, train_ddp, train_zero, train_cp, train_pp, train_ep, plan, collectives; "
            "print('torch._dynamo' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr


def test_bf16_autocast_runs(tiny_data, tmp_path):
    out, _ = run_single(tiny_argv(tiny_data, str(tmp_path), max_steps=2, dtype="bfloat16"))
    assert len(out) == 2 and all(torch.isfinite(torch.tensor(out)))


def test_fp8_flag_swaps_block_linears(tiny_data, tmp_path):
    """--fp8 trains (the blocks' Linears run FP8 GEMMs) close to fp32 over a few steps, and is not silent."""
    ref, _ = run_single(tiny_argv(tiny_data, str(tmp_path / "fp32"), max_steps=4))
    fp8, _ = run_single(tiny_argv(tiny_data, str(tmp_path / "fp8"), max_steps=4, fp8="blockwise"))
    assert fp8 != ref                                   # the FP8 path really ran
    assert all(abs(a - b) < 0.02 * a for a, b in zip(ref, fp8))


# ----------------------------------------------------------------------------------------------------------
# --kernels, --fp8 and TF32 in every rung: applied as train_single applies them, or refused with one line

SCRIPTS = ("train_ddp", "train_zero", "train_tp", "train_cp", "train_pp", "train_ep")
FAST_PATHS = dict(kernels="triton", fp8="tensorwise", max_steps=3)


def _run_main(script, argv):
    """script.main(argv) on one process (a one-rank group); returns its result, or the SystemExit code."""
    import importlib
    import torch.distributed as dist
    try:
        return importlib.import_module(script).main(argv)
    except SystemExit as e:
        return e.code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def fast_single(tiny_data, tmp_path_factory):
    """fast_single(**moe) -> train_single's losses with FAST_PATHS (and an MoE's flags), run once per module: the
    reference every rung below is compared with."""
    cache = {}

    def reference(**moe):
        key = tuple(sorted(moe.items()))
        if key not in cache:
            out = str(tmp_path_factory.mktemp("fast_single"))
            cache[key] = run_single(tiny_argv(tiny_data, out, **FAST_PATHS, **moe))[0]
        return cache[key]
    return reference


@pytest.mark.parametrize("script, flags", [("train_ddp", {}), ("train_zero", dict(zero_stage=2)),
                                           ("train_pp", dict(pp=1)), ("train_cp", dict(cp=1)), ("train_tp", dict(tp=1)),
                                           ("train_ep", dict(ep=1, n_experts=2, top_k=1, moe_every=2))])
def test_kernels_and_fp8_applied_like_single(script, flags, tiny_data, tmp_path, fast_single):
    """Fused Triton modules (interpreted on CPU) and FP8 GEMMs swapped into the rung's model as train_single does
    (the modules are there; train_tp's FP8 GEMMs sit inside its parallel layers), and the run equals train_single's
    with the same flags on the same micro-batches."""
    from kernels.apply import FusedLayerNorm
    from kernels.fp8 import Float8Linear
    from converters.fp8_tp import Float8ParallelGemms
    moe = {k: v for k, v in flags.items() if k != "ep"} if script == "train_ep" else {}
    ref = fast_single(**moe)
    result = _run_main(script, tiny_argv(tiny_data, str(tmp_path / script), **FAST_PATHS, **flags))
    model = result.get("model") or result.get("chunks")
    kinds = {type(m) for m in model.modules()}
    fp8 = [m for m in model.modules() if isinstance(m, Float8Linear) or isinstance(getattr(m, "gemm", None),
                                                                                 Float8ParallelGemms)]
    assert FusedLayerNorm in kinds and fp8, kinds
    assert_same_losses(ref, losses(str(tmp_path / script)), rtol=1e-5)


def test_kernels_and_fp8_refused_where_they_cannot_apply(tiny_data, tmp_path, capsys):
    """ZeRO-3's FP8 all-gather of rowwise weights (two encodings of W): one error line (train_5d's refusals:
    tests/test_5d.py)."""
    flags = dict(zero_stage=3, fp8="rowwise", fp8_all_gather=True)
    assert _run_main("train_zero", tiny_argv(tiny_data, str(tmp_path / "bad"), **flags)) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--fp8" in err, err


def test_tf32_enabled_in_every_script():
    """TF32 for fp32 matmuls on CUDA is set by one helper, which every train script calls (no-op on CPU)."""
    # saved and restored by hand: the flag is a property of torch's backend module, which monkeypatch cannot undo
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        precision.enable_tf32(torch.device("cpu"))
        assert not torch.backends.cuda.matmul.allow_tf32
        precision.enable_tf32(torch.device("cuda"))          # a device object: no GPU needed to set the flag
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    for script in ("train_single",) + SCRIPTS:
        with open(os.path.join(ROOT, f"{script}.py")) as f:
            source = f.read()
        assert "enable_tf32(env.device)" in source, script
        assert script == "train_single" or "allow_tf32" not in source, f"{script} sets TF32 by hand"


@pytest.mark.parametrize("flags,message", [
    (["--lr", "-1"], "--lr must be a finite number >= 0"), (["--lr", "inf"], "--lr must be a finite number"),
    (["--weight_decay", "-5"], "--weight_decay must be"), (["--seed", "-1"], "--seed must be >= 0"),
    (["--dist_timeout", "0"], "--dist_timeout must be between"), (["--stop_step", "-3"], "--stop_step must be"),
    (["--stop_step", "30"], "is past --max_steps"), (["--out_dir", ""], "--out_dir must name a directory"),
    (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "cuda:99"], "cuda"),
    (["--resume"], "--resume: no checkpoint at"),
    (["--n_kv_head", "3"], "--n_kv_head 3 must divide n_head=4"),
    (["--arch", "mixtral"], "--arch mixtral is a mixture of experts: give --n_experts"),
    (["--rope_scaling", "8,4,1,8192"], "--rope_scaling '8,4,1,8192': give FACTOR"),
])
def test_bad_values_are_one_clear_line(tiny_data, tmp_path, capsys, flags, message):
    argv = tiny_argv(tiny_data, str(tmp_path / "run"), max_steps=20)
    with pytest.raises(SystemExit) as e:
        train_single.main(argv + flags)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def test_resume_from_a_broken_or_foreign_checkpoint_is_one_clear_line(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    run_single(tiny_argv(tiny_data, str(out), max_steps=2))
    for name, damage in (("truncated", lambda b: b[: len(b) // 2]), ("empty", lambda b: b"")):
        ckpt = Path(latest_checkpoint(str(out)))
        good = ckpt.read_bytes()
        ckpt.write_bytes(damage(good))
        with pytest.raises(SystemExit) as e:
            train_single.main(tiny_argv(tiny_data, str(out), max_steps=4, resume=True))
        ckpt.write_bytes(good)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and "not a readable checkpoint" in err[0], (name, err)
    with pytest.raises(SystemExit) as e:            # a checkpoint of another model shape
        train_single.main(tiny_argv(tiny_data, str(out), max_steps=4, resume=True, n_embd=48))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "does not match this model" in err[0], err
