"""--data_mix (common/data_mix.py): sources drawn at their weights, the same tokens in every layout (float64 parity
of train_ddp at dp 2 with train_single on a two-source mixture), per-source metrics, exact resume, refusals."""
import json
import os

import numpy as np
import pytest
import torch

from distributed_helper import run_workers
from common.data import DEFAULT_DATA_DIR as DEFAULT       # (--data_mix replaces --data_dir: left at its default)
from train_helpers import EXACT, assert_exact, assert_same_weights, curves, run_single, text_argv, tiny_argv


def _corpus(path, tokens, tokenizer="byte", vocab_size=256, n_val=2_000):
    os.makedirs(path, exist_ok=True)
    tokens = np.asarray(tokens, dtype=np.uint16)
    tokens[:-n_val].tofile(os.path.join(path, "train.bin"))
    tokens[-n_val:].tofile(os.path.join(path, "val.bin"))
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(dict(vocab_size=vocab_size, tokenizer=tokenizer, train_tokens=len(tokens) - n_val,
                       val_tokens=n_val), f)
    return path


@pytest.fixture(scope="module")
def banded(tmp_path_factory):
    """Three corpora with disjoint token bands (0-63, 64-127, 128-191): a token tells its source."""
    root = tmp_path_factory.mktemp("banded")
    rng = np.random.default_rng(0)
    return [_corpus(str(root / f"s{k}"), 64 * k + rng.integers(0, 64, size=12_000 + 3_000 * k)) for k in range(3)]


@pytest.fixture(scope="module")
def second_text(tmp_path_factory):
    """A second real-text corpus (other stdlib modules, bytes) beside text_data: the mixture's other source."""
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    text = b"".join(open(os.path.join(root, name), "rb").read() for name in ("difflib.py", "textwrap.py"))
    return _corpus(str(tmp_path_factory.mktemp("second_text")), np.frombuffer(text, dtype=np.uint8), n_val=10_000)


def test_sampled_share_within_three_standard_errors(banded):
    from common.data_mix import MixtureCounts, MixtureLoader
    weights, G, steps, T = (0.6, 0.3, 0.1), 100, 100, 8          # 10,000 sequences
    sources = list(zip(banded, weights))
    loader = MixtureLoader(sources, T, G, seed=3)
    counts = np.zeros(3)
    for step in range(steps):
        which, _ = loader.global_batch(step)
        x, y = loader.micro_batch(step, 0, G)
        assert (x // 64 == torch.from_numpy(which)[:, None]).all() and (y // 64 == x // 64).all()
        counts += np.bincount(which, minlength=3)
    n = G * steps
    for k, w in enumerate(weights):
        se = (w * (1 - w) / n) ** 0.5
        assert abs(counts[k] / n - w) <= 3 * se, f"source {k}: share {counts[k] / n:.4f} vs weight {w} (se {se:.4f})"
    tally = MixtureCounts(sources, 3, G, T).metrics(steps - 1)      # what metrics.jsonl reports agrees
    assert list(tally["tokens_by_source"].values()) == [int(c) * T for c in counts]
    assert tally["epochs_by_source"][banded[2]] == counts[2] * T / (18_000 - 2_000)


def test_dp_slices_and_zero_weight(banded):
    """A DP rank's micro-batch is its slice of the global batch; a zero-weight source is never drawn."""
    from common.data_mix import MixtureLoader
    loader = MixtureLoader([(banded[0], 1.0), (banded[1], 0.0), (banded[2], 2.0)], 8, 12, seed=1)
    whole = loader.micro_batch(5, 0, 12)[0]
    parts = [loader.micro_batch(5, m, 3, dp_rank=r, dp_size=2)[0] for r in range(2) for m in range(2)]
    assert torch.equal(torch.cat(parts), whole)
    assert not any((loader.global_batch(s)[0] == 1).any() for s in range(50))


def _ddp_worker(rank, n, argv):
    import train_ddp
    result = train_ddp.main(argv)
    return {k: p.detach().numpy().copy() for k, p in result["model"].named_parameters()} if rank == 0 else None


def test_two_source_mixture_dp2_matches_single_float64(text_data, second_text, tmp_path):
    mix = f"{text_data}:0.7,{second_text}:0.3"
    ref = run_single(text_argv(DEFAULT, str(tmp_path / "single"), micro_batch_size=8, data_mix=mix), both_curves=True)
    out = str(tmp_path / "ddp")
    weights = run_workers(_ddp_worker, 2, args=(text_argv(DEFAULT, out, micro_batch_size=2, data_mix=mix),),
                          timeout=600)[0]
    assert_exact(ref[0], curves(out))
    assert_same_weights(ref[1], {k: torch.from_numpy(a) for k, a in weights.items()}, rtol=EXACT)


def _rows(out_dir):
    """Every metrics.jsonl row by (kind, step), the later row winning (a resumed run repeats none here)."""
    rows = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            rows[("val" if "val_loss" in row else "train", row["step"])] = row
    return rows


TIMED = ("step_time_s", "tokens_per_s", "mfu", "peak_mem_bytes", "peak_reserved_bytes")   # measured, not computed


def test_resumed_mixture_equals_unbroken_run_bitwise(banded, tmp_path):
    mix = f"{banded[0]}:2,{banded[1]}:1,{banded[2]}:1"
    flags = dict(data_mix=mix, max_steps=8, eval_interval=3, eval_iters=2)
    unbroken, broken = str(tmp_path / "unbroken"), str(tmp_path / "broken")
    run_single(tiny_argv(DEFAULT, unbroken, **flags))
    run_single(tiny_argv(DEFAULT, broken, stop_step=4, **flags))
    run_single(tiny_argv(DEFAULT, broken, resume=True, **flags))
    a, b = _rows(unbroken), _rows(broken)
    assert a.keys() == b.keys()
    for key in a:
        untimed = [{k: v for k, v in row[key].items() if k not in TIMED} for row in (a, b)]
        assert untimed[0] == untimed[1], key
    assert set(a[("val", 3)]["val_loss_by_source"]) == set(banded)
    assert a[("train", 7)]["tokens_by_source"][banded[0]] > a[("train", 7)]["tokens_by_source"][banded[1]]


@pytest.mark.parametrize("mix,message", [
    ("{a}:-1,{b}:1", "the weight must be a finite number >= 0"),
    ("{a}:nan,{b}:1", "the weight must be a finite number >= 0"),
    ("{a}:1_0,{b}:1", "plain decimal digits"),
    ("{a}:0,{b}:0", "the weights sum to zero"),
    ("{a}:1,{a}/missing:1", "no such directory"),
    ("{a}:1,{b}", "expected DIR:WEIGHT"),
    ("{a}:1,{a}:2", "names"),
    ("{a}:1,{c}:1", "disagree on tokenizer"),
    ("{a}:1 --data_dir {b}", "replaces --data_dir"),
])
def test_refusals_are_one_line(banded, tmp_path, capsys, mix, message):
    import train_single
    other = _corpus(str(tmp_path / "other"), np.arange(12_000) % 256, tokenizer="gpt2")
    mix, _, data_dir = mix.format(a=banded[0], b=banded[1], c=other).partition(" --data_dir ")
    argv = tiny_argv(data_dir or DEFAULT, str(tmp_path / "out"), data_mix=mix)
    with pytest.raises(SystemExit) as exc:
        train_single.main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.startswith("error:") and message in err and "\n" not in err, err


def test_a_mixture_prints_its_sample_and_an_undecodable_one_stops_before_the_first_step(banded, tmp_path, capsys):
    """The end-of-run sample decodes with the sources' shared tokenizer (bytes here); a tokenizer whose files are
    missing (an hf corpus without its tokenizer.json) is one error line before any step, not a sample saying so."""
    run_single(tiny_argv(DEFAULT, str(tmp_path / "run"), data_mix=f"{banded[0]}:1,{banded[1]}:1", max_steps=1,
                         sample_tokens=16))
    out = capsys.readouterr().out
    assert "---- sample ----\n" in out and "cannot decode" not in out, out
    import train_single
    hf = [_corpus(str(tmp_path / f"hf{k}"), np.arange(12_000) % 256, tokenizer="hf") for k in range(2)]
    with pytest.raises(SystemExit) as exc:
        train_single.main(tiny_argv(DEFAULT, str(tmp_path / "hf_run"), data_mix=f"{hf[0]}:1,{hf[1]}:1",
                                    sample_tokens=16))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert "sample cannot be decoded" in err and "no tokenizer.json" in err and "--sample_tokens 0" in err, err
    assert not (tmp_path / "hf_run" / "metrics.jsonl").exists()
