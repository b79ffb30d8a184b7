"""What defines a run besides its model (common/run_identity.py): a resume reads the corpus it was trained on, known by
content wherever it lies, and every rank of a run shares its flags and its corpus, or all stop naming the first
difference."""
import os
import shutil

import numpy as np
import pytest

import train_single
from common.checkpoint import load_checkpoint, latest_checkpoint
from common.data import DEFAULT_DATA_DIR            # (--data_mix replaces --data_dir: left at its default)
from common.run_identity import corpus_fingerprint
from distributed_helper import exit_code_and_stderr, run_workers
from train_helpers import make_tiny_dataset, run_single, tiny_argv


def copy_with_one_token_changed(src, dst, where):
    shutil.copytree(src, dst)
    tokens = np.fromfile(os.path.join(dst, "train.bin"), dtype=np.uint16)
    tokens[where] = (tokens[where] + 1) % 64
    tokens.tofile(os.path.join(dst, "train.bin"))
    return str(dst)


def test_the_fingerprint_knows_a_corpus_by_content(tiny_data, tmp_path):
    shutil.copytree(tiny_data, tmp_path / "copy")
    assert corpus_fingerprint(str(tmp_path / "copy")) == corpus_fingerprint(tiny_data)
    for where in (0, -1):                                           # the first and the last MiB are read
        assert corpus_fingerprint(copy_with_one_token_changed(tiny_data, tmp_path / f"e{where}", where)) != \
            corpus_fingerprint(tiny_data)
    other_meta = make_tiny_dataset(str(tmp_path / "vocab"), vocab_size=65)
    assert corpus_fingerprint(other_meta) != corpus_fingerprint(tiny_data)


def test_a_resume_reads_the_corpus_it_was_trained_on_wherever_it_lies(tiny_data, tmp_path, capsys, monkeypatch):
    """Resumed on a copy at another path, or with a relative --data_dir from another directory: the run goes on.
    Resumed on another corpus (one token differs), or on a mixture with other weights: one line, before any step."""
    out = str(tmp_path / "run")
    shutil.copytree(tiny_data, tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    run_single(tiny_argv("data", out, max_steps=2, save_interval=2))
    state = load_checkpoint(latest_checkpoint(out))
    assert state["config"]["data_dir"] == str(tmp_path / "data")                   # recorded absolute
    monkeypatch.chdir(tmp_path / "run")
    assert len(run_single(tiny_argv("../data", out, max_steps=3, save_interval=3, resume="yes"))[0]) == 3
    moved = shutil.copytree(tmp_path / "data", tmp_path / "moved")
    assert len(run_single(tiny_argv(str(moved), out, max_steps=4, save_interval=4, resume="yes"))[0]) == 4
    other = copy_with_one_token_changed(tiny_data, tmp_path / "other", 5)
    for argv in (tiny_argv(other, out, max_steps=5, resume="yes"),
                 tiny_argv(DEFAULT_DATA_DIR, out, max_steps=5, resume="yes", data_mix=f"{tiny_data}:1,{other}:1")):
        with pytest.raises(SystemExit) as e:
            train_single.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1, err
        assert "the checkpoint was trained on" in err[0] and "another corpus by content or weight" in err[0], err
        assert "Resume with the corpus it was trained on" in err[0], err


@pytest.mark.parametrize("rank1_flags, named", [
    (dict(lr=2e-3), "--lr"),
    (dict(n_layer=3), "--n_layer"),
    (dict(data_dir="OTHER"), "the corpus (by content)"),
])
def test_ranks_launched_differently_stop_naming_the_first_difference(tiny_data, tmp_path, rank1_flags, named):
    """Two nodes started with different command lines, or each with a corpus of its own: every rank stops at start
    with one line naming the flag (or the corpus) where rank 1 differs from rank 0. A corpus at another path with
    the same content is no difference."""
    other = copy_with_one_token_changed(tiny_data, tmp_path / "other", 7)
    run = str(tmp_path / "run")
    rank1 = {k: (other if v == "OTHER" else v) for k, v in rank1_flags.items()}
    argvs = [tiny_argv(tiny_data, run, max_steps=1), tiny_argv(rank1.pop("data_dir", tiny_data), run, max_steps=1, **rank1)]
    results = run_workers(exit_code_and_stderr_of_rank, 2, args=("train_ddp", argvs))
    for code, err in results:
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and f"rank 1 differs from rank 0 in {named}" in lines[0], err
        assert "every rank must run the same command on the same corpus" in lines[0], err


def exit_code_and_stderr_of_rank(rank, world_size, script, argvs):
    """exit_code_and_stderr with each rank's own argv."""
    return exit_code_and_stderr(rank, world_size, script, argvs[rank])


def test_the_same_corpus_at_another_path_on_another_node_agrees(tiny_data, tmp_path):
    copy = str(shutil.copytree(tiny_data, tmp_path / "node1_copy"))
    argvs = [tiny_argv(tiny_data, str(tmp_path / "run"), max_steps=1), tiny_argv(copy, str(tmp_path / "run"),
                                                                                max_steps=1)]
    assert [code for code, _ in run_workers(exit_code_and_stderr_of_rank, 2, args=("train_ddp", argvs))] == [0, 0]


def test_a_mixture_knows_its_sources_by_what_they_are(tiny_data, tmp_path, monkeypatch):
    """One directory under two spellings (a trailing slash, ./, a symlink) is one source, named twice; two corpora
    whose tokenizer files differ in content do not mix, though meta.json calls both 'hf' with one vocab size."""
    from common.config import ConfigError
    from common.data_mix import check_tokenizers_agree, parse_data_mix
    os.symlink(tiny_data, tmp_path / "link")
    monkeypatch.chdir(os.path.dirname(tiny_data))
    name = os.path.basename(tiny_data)
    for twin in (f"{tiny_data}/", f"./{name}", str(tmp_path / "link")):
        with pytest.raises(ConfigError, match=f"--data_mix names {twin} twice \\(as {tiny_data}\\)"):
            parse_data_mix(f"{tiny_data}:1,{twin}:2")
    a, b = (shutil.copytree(tiny_data, tmp_path / n) for n in ("a", "b"))
    (a / "tokenizer.json").write_text('{"model": {"vocab": {"x": 0}}}')
    (b / "tokenizer.json").write_text('{"model": {"vocab": {"y": 0}}}')
    meta = dict(tokenizer="hf", vocab_size=64)
    with pytest.raises(ValueError, match="disagree on tokenizer files \\(another tokenizer.json by content\\)"):
        check_tokenizers_agree([str(a), str(b)], [meta, meta])
    (b / "tokenizer.json").write_text((a / "tokenizer.json").read_text())
    check_tokenizers_agree([str(a), str(b)], [meta, meta])


def test_a_corpus_changed_under_a_running_job_stops_it_naming_the_file(tiny_data, tmp_path, capsys):
    """A token file cut short while the run reads it (a memory-mapped read past its new end is SIGBUS, the process
    gone without a word) and an id past the vocabulary anywhere in it (opening samples a large file) stop the run at
    the next batch that would read them, in one line naming the file."""
    from common.data import GlobalBatchLoader
    data = shutil.copytree(tiny_data, tmp_path / "data")
    loader = GlobalBatchLoader(str(data), block_size=16, global_batch_size=8, seed=0)
    path = data / "train.bin"
    offsets = loader.global_batch_offsets(3)
    tokens = np.memmap(path, dtype=np.uint16, mode="r+")
    tokens[offsets[0] + 5] = 64                                  # vocab_size is 64: ids 0..63
    tokens.flush()
    with pytest.raises(SystemExit):
        loader.micro_batch(3, 0, 8)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path} holds token id 64 in tokens {offsets[0]:,}.." in err[0], err
    del tokens
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(SystemExit):
        loader.micro_batch(3, 0, 8)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path} is now" in err[0] and "the corpus changed under the run" in err[0], err
