"""data.py: deterministic global batches, fixed slices per DP rank / micro-step, and preparation."""
import json
import os

import numpy as np
import pytest
import torch

from common.data import GlobalBatchLoader, encode, write_dataset
from distributed_helper import run_workers


def test_same_step_same_batch_and_different_steps_differ(tiny_data):
    a = GlobalBatchLoader(tiny_data, 16, 8, seed=5)
    b = GlobalBatchLoader(tiny_data, 16, 8, seed=5)
    x1, y1 = a.micro_batch(3, 0, 8)
    x2, y2 = b.micro_batch(3, 0, 8)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, a.micro_batch(4, 0, 8)[0])
    assert not torch.equal(x1, GlobalBatchLoader(tiny_data, 16, 8, seed=6).micro_batch(3, 0, 8)[0])
    assert torch.equal(x1[:, 1:], y1[:, :-1])          # targets are the inputs shifted by one


def test_slices_tile_the_global_batch(tiny_data):
    loader = GlobalBatchLoader(tiny_data, 16, 12, seed=1)
    full, _ = loader.micro_batch(7, 0, 12)
    for dp in (1, 2, 3):
        for mbs in (1, 2):
            per_rank = 12 // dp
            pieces = [loader.micro_batch(7, m, mbs, dp_rank=r, dp_size=dp)[0]
                      for r in range(dp) for m in range(per_rank // mbs)]
            assert torch.equal(torch.cat(pieces), full), (dp, mbs)


def test_val_split_is_separate(tiny_data):
    loader = GlobalBatchLoader(tiny_data, 16, 4, seed=1)
    assert not torch.equal(loader.micro_batch(0, 0, 4)[0], loader.micro_batch(0, 0, 4, split="val")[0])


def test_write_dataset_roundtrip(tmp_path):
    tokens, vocab = encode("héllo world\n".encode() * 50, "byte")
    assert vocab == 256 and tokens.dtype == np.uint16
    meta = write_dataset(str(tmp_path), tokens, vocab, "byte", "test")
    train = np.memmap(os.path.join(tmp_path, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(tmp_path, "val.bin"), dtype=np.uint16, mode="r")
    assert np.array_equal(np.concatenate([train, val]), tokens)
    assert json.load(open(os.path.join(tmp_path, "meta.json"))) == meta
    assert meta["train_tokens"] + meta["val_tokens"] == len(tokens)


def _two_node_worker(rank, world, root, data_dir):
    """One rank of a simulated 2-node job (2 ranks per node, no shared filesystem: each node its own working
    directory); returns (exit code, this rank's stderr, files left in its node's data directory)."""
    import contextlib
    import io
    from common import data
    from common import startup
    from common.distributed import init_distributed
    from common.config import Config
    os.environ["LOCAL_RANK"] = str(rank % 2)
    os.chdir(os.path.join(root, f"node{rank // 2}"))
    stdlib_root, files = data.stdlib_text_files()
    data.stdlib_text_files = lambda: (stdlib_root, files[:30])      # a small default corpus: fast
    cfg = Config(data_dir=data_dir, device="cpu", block_size=16, global_batch_size=4, dist_timeout=60,
                 out_dir=os.path.join(root, "out"))            # the out_dir every node shares (data is per node)
    env = init_distributed(cfg)
    err, code = io.StringIO(), 0
    with contextlib.redirect_stderr(err):
        try:
            loader = startup.prepare_data(cfg, env)
            assert loader.vocab_size == 256
        except SystemExit as e:
            code = e.code
    listing = sorted(os.listdir(data_dir)) if os.path.isdir(data_dir) else []
    return code, err.getvalue(), listing


def test_every_node_prepares_its_own_data(tmp_path):
    """Without a shared filesystem each node's local rank 0 prepares the default corpus (no node waits on a
    file only another node has, no half-written temporary file stays); a dataset missing on one node makes
    that node's preparer print its own error (rank 0 only could not) and every rank exit with code 2."""
    from common.distributed import DistEnv
    from common.startup import prepares_data
    assert [prepares_data(DistEnv(r, 4, r % 2, torch.device("cpu"), "gloo")) for r in range(4)] == [True, False] * 2
    for node in ("node0", "node1"):
        os.makedirs(tmp_path / node)
    results = run_workers(_two_node_worker, 4, args=(str(tmp_path), os.path.join("data", "stdlib")), timeout=300)
    for code, err, listing in results:
        assert code == 0 and listing == ["meta.json", "train.bin", "val.bin"], (code, err, listing)
    write_dataset(str(tmp_path / "node0" / "mine"), encode(b"only on node 0 " * 100, "byte")[0], 256, "byte", "t")
    results = run_workers(_two_node_worker, 4, args=(str(tmp_path), "mine"), timeout=300)
    assert [code for code, _, _ in results] == [2, 2, 2, 2]
    errs = [err for _, err, _ in results]
    # node 1's preparer (rank 2) reports for its node; rank 0 points to it; the others stay quiet
    assert errs[2].startswith("error: rank 2: no dataset in 'mine'"), errs
    assert errs[0].startswith("error: another rank failed") and errs[1] == errs[3] == "", errs


def _prepare(argv, capsys):
    """python -m common.data argv in this process: (exit code, stderr lines)."""
    from common import data
    code = 0
    try:
        data.main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("case, content, message", [
    ("missing", None, "no such file"), ("a directory", "dir", "a directory, not a file"),
    ("empty", b"", "0 token(s), too few"), ("one byte", b"x", "1 token(s), too few"),
    ("29 bytes", b"x" * 29, "29 token(s), too few")])
def test_preparing_from_a_bad_input_is_one_line_and_keeps_a_good_dataset(tmp_path, capsys, case, content, message):
    """A missing, directory, empty or too short --input: one `error:` line, exit 2, and the good dataset already
    in --out_dir is left exactly as it was (nothing is written before the input is known to be usable)."""
    good = tmp_path / "data"
    write_dataset(str(good), np.arange(1000, dtype=np.uint16) % 64, 64, "byte", "test")
    before = {name: (good / name).read_bytes() for name in os.listdir(good)}
    path = tmp_path / "input.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    code, lines = _prepare(["--input", str(path), "--out_dir", str(good)], capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert {name: (good / name).read_bytes() for name in os.listdir(good)} == before


def test_thirty_bytes_make_a_usable_dataset(tmp_path, capsys, tiny_data):
    """The smallest input data.py accepts trains (block_size 1: 3 tokens per split)."""
    path = tmp_path / "input.txt"
    path.write_bytes(bytes(range(65, 95)))
    assert _prepare(["--input", str(path), "--out_dir", str(tmp_path / "d")], capsys)[0] == 0
    loader = GlobalBatchLoader(str(tmp_path / "d"), 1, 2, seed=0)
    assert loader.micro_batch(0, 0, 2)[0].shape == (2, 1)


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_out_dir_that_is_a_file_is_one_line(tmp_path, capsys, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    (tmp_path / "in.txt").write_bytes(b"some text " * 10)
    out = blocker if where == "a file" else blocker / "data"
    code, lines = _prepare(["--input", str(tmp_path / "in.txt"), "--out_dir", str(out)], capsys)
    assert code == 2 and len(lines) == 1 and f"{blocker} is a file" in lines[0], lines
    assert blocker.read_text() == "a file"


def test_too_few_tokens_for_block_size_says_how_many_are_needed(tmp_path):
    write_dataset(str(tmp_path), np.arange(200, dtype=np.uint16) % 64, 64, "byte", "test")
    with pytest.raises(ValueError) as e:
        GlobalBatchLoader(str(tmp_path), 19, 2, seed=0)         # val.bin holds 20 tokens: 19 + 2 = 21 needed
    assert "has 20 tokens; --block_size 19 needs at least block_size + 2 = 21" in str(e.value)
    GlobalBatchLoader(str(tmp_path), 18, 2, seed=0)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])
def test_a_write_stopped_half_way_keeps_the_dataset_and_its_tokenizer_files(tmp_path, monkeypatch, stop):
    """A corpus prepared again with another tokenizer's files (tokenizer.json), stopped while its meta.json is written
    (a Ctrl-C, a full disk): the directory is byte for byte what it was, the tokenizer files included, never the new
    tokenizer beside the old ids; written whole, the new files are all there and no temporary file is left."""
    old_tok, new_tok, out = tmp_path / "old_tok", tmp_path / "new_tok", tmp_path / "corpus"
    for directory, text in ((old_tok, '{"old": 1}'), (new_tok, '{"new": 2}')):
        directory.mkdir()
        (directory / "tokenizer.json").write_text(text)
    write_dataset(str(out), np.arange(300, dtype=np.uint16) % 64, 64, "hf", "old", tokenizer_from=str(old_tok))
    before = {name: (out / name).read_bytes() for name in sorted(os.listdir(out))}
    assert before["tokenizer.json"] == b'{"old": 1}'
    real_dump = json.dump

    def dump(*args, **kwargs):
        raise stop(28, "No space left on device") if stop is OSError else stop()
    monkeypatch.setattr(json, "dump", dump)
    with pytest.raises(stop):
        write_dataset(str(out), np.arange(400, dtype=np.uint16) % 32, 32, "hf", "new", tokenizer_from=str(new_tok))
    assert {name: (out / name).read_bytes() for name in sorted(os.listdir(out))} == before
    monkeypatch.setattr(json, "dump", real_dump)
    write_dataset(str(out), np.arange(400, dtype=np.uint16) % 32, 32, "hf", "new", tokenizer_from=str(new_tok))
    assert sorted(os.listdir(out)) == sorted(before) and (out / "tokenizer.json").read_bytes() == b'{"new": 2}'
    assert json.loads((out / "meta.json").read_text())["source"] == "new"
