"""
data.py: prepare a corpus into nanoGPT-style .bin files, and serve deterministic global batches.

Preparation (run once; train scripts do it automatically for the default corpus):

    python -m common.data                                   # default: this Python's standard library, bytes
    python -m common.data --input my.txt --tokenizer gpt2   # any text files, GPT-2 BPE (tiktoken: internet once)
    python -m common.data --input my.txt --tokenizer HF_DIR # a Hugging Face tokenizer.json (offline)
    python -m common.data --shakespeare                     # tiny-shakespeare download, byte tokens

Output in --out_dir (default data/stdlib): train.bin and val.bin (uint16 memmaps: every token id < 2^16,
so nanoGPT-prepared directories work unchanged via --data_dir) and meta.json (vocab_size, tokenizer,
source, token counts), with the tokenizer's files for gpt2 and HF_DIR (docs/huggingface.md).

The default corpus needs no download and exists wherever Python does: the source code of the running
interpreter's standard library (~15-20 MB of text), tokenised as raw bytes (vocab 256).

Loading (docs/parity.md): the global batch of optimizer step s is a fixed function of (seed, s):
`global_batch_offsets` draws global_batch_size start offsets from a generator seeded by (seed, s). A DP rank's
micro-batch is a fixed slice of it (`micro_batch`), so every layout sees exactly the same tokens per step.
"""
if __name__ == "__main__":      # run as a script: from here on, torch's import included, a Ctrl-C is one line
    from common.errors import report_interrupts
    report_interrupts()
import argparse
import json
import math
import os
import pickle
import socket
import sys
import sysconfig
import urllib.request

import numpy as np
import torch

from common.errors import fail, report_interrupts

DEFAULT_DATA_DIR = os.path.join("data", "stdlib")
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


# ----------------------------------------------------------------------------------------------------------
# preparation

def stdlib_text_files():
    """Every .py file of the running interpreter's standard library, in a stable (sorted) order."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return root, files


def encode(text_bytes, tokenizer):
    if tokenizer == "byte":
        return np.frombuffer(text_bytes, dtype=np.uint8).astype(np.uint16), 256
    from common.hf.tokenizer import encode_with, gpt2_encoding     # (the tokenizers' own module)
    if tokenizer == "gpt2":
        enc = gpt2_encoding()
        ids = enc.encode_ordinary(text_bytes.decode("utf-8", errors="replace"))
        return np.array(ids, dtype=np.uint16), enc.n_vocab          # 50257 < 2^16
    ids, vocab = encode_with(tokenizer, text_bytes)                 # a Hugging Face tokenizer.json
    return np.array(ids, dtype=np.uint16), vocab


MIN_SPLIT_TOKENS = 3        # block_size 1 needs block_size + 2 tokens in a split (GlobalBatchLoader)


def write_dataset(out_dir, tokens, vocab_size, tokenizer, source, val_fraction=0.1, tokenizer_from=None):
    """Split tokens (last val_fraction for validation) and write train.bin / val.bin / meta.json. Too few tokens
    for a usable dataset is a ValueError before anything is written (a good dataset there stays as it was); a
    failed write removes its temporary files and raises OSError naming the directory. tokenizer_from: byte, gpt2
    or a Hugging Face tokenizer's directory, whose files are written next to meta.json (hf/tokenizer.py)."""
    n_val = max(int(len(tokens) * val_fraction), 1)
    if len(tokens) - n_val < MIN_SPLIT_TOKENS or n_val < MIN_SPLIT_TOKENS:
        raise ValueError(f"{source}: {len(tokens)} token(s), too few for a dataset (train and val need at least "
                         f"{MIN_SPLIT_TOKENS} each, val being the last {val_fraction:.0%}: at least "
                         f"{math.ceil(MIN_SPLIT_TOKENS / val_fraction)} tokens); nothing was written to {out_dir}")
    os.makedirs(out_dir, exist_ok=True)
    splits = {"train": tokens[:-n_val], "val": tokens[-n_val:]}
    meta = dict(vocab_size=vocab_size, tokenizer=tokenizer, source=source,
                train_tokens=int(len(splits["train"])), val_tokens=int(len(splits["val"])))
    if tokenizer == "hf":
        meta["tokenizer_from"] = os.path.abspath(tokenizer_from)
    staged = []                                      # (temporary, final) paths, renamed into place at the end

    def stage(name):
        """A temporary path for out_dir/name that no other writer uses: nodes sharing a filesystem may each prepare
        the same corpus at once, each renaming its own files into place (the same bytes: the last changes nothing)."""
        staged.append((os.path.join(out_dir, f"{name}.{socket.gethostname()}.{os.getpid()}.tmp"),
                       os.path.join(out_dir, name)))
        return staged[-1][0]
    try:
        for split in splits:
            splits[split].astype(np.uint16).tofile(stage(f"{split}.bin"))
        if tokenizer_from is not None:               # its files too: never one tokenizer's ids beside another's
            from common.hf.tokenizer import write_tokenizer_files
            write_tokenizer_files(tokenizer_from, stage)
        with open(stage("meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
    except BaseException as e:                       # a full disk, a Ctrl-C: the dataset there (if any) stays as it was
        for tmp, _ in staged:
            if os.path.exists(tmp):
                os.remove(tmp)
        if not isinstance(e, OSError):
            raise
        raise OSError(f"cannot write the dataset to {out_dir} ({e.strerror or e}); nothing there was changed") \
            from None
    for tmp, final in staged:
        os.replace(tmp, final)      # meta.json last: a meta.json means the .bin and tokenizer files are complete
    return meta


def prepare_stdlib(out_dir=DEFAULT_DATA_DIR):
    root, files = stdlib_text_files()
    print(f"data: preparing the default corpus from {len(files)} standard-library files in {root} ...",
          flush=True)
    chunks = []
    for path in files:
        with open(path, "rb") as f:
            chunks.append(f.read())
    tokens, vocab = encode(b"\n".join(chunks), "byte")
    meta = write_dataset(out_dir, tokens, vocab, "byte", f"python {sys.version.split()[0]} stdlib: {root}")
    print(f"data: wrote {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens to {out_dir}",
          flush=True)
    return meta


def read_inputs(paths):
    """The bytes of every --input file, joined by newlines; ValueError naming a path that is not a readable file."""
    chunks = []
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"--input {path}: {not_a_file(path)}")
        try:
            with open(path, "rb") as f:
                chunks.append(f.read())
        except OSError as e:
            raise ValueError(f"--input {path}: cannot read it ({e.strerror or e})") from None
    return b"\n".join(chunks)


def not_a_file(path):
    """Why `path` is not a regular file (a pipe or a device would block or never end)."""
    if os.path.islink(path) and not os.path.exists(path):
        return f"a symbolic link to {os.readlink(path)}, which does not resolve (missing, or a loop)"
    if not os.path.exists(path):
        return "no such file"
    return "a directory, not a file" if os.path.isdir(path) else "not a regular file (a pipe, a socket or a device)"


def prepare_text_files(paths, out_dir, tokenizer):
    tokens, vocab = encode(read_inputs(paths), tokenizer)
    name = tokenizer if tokenizer in ("byte", "gpt2") else "hf"     # meta.json's name for a tokenizer.json
    return write_dataset(out_dir, tokens, vocab, name, ", ".join(paths), tokenizer_from=tokenizer)


def prepare_shakespeare(out_dir, tokenizer):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "input.txt")
    if not os.path.exists(path):
        print(f"data: downloading {SHAKESPEARE_URL}", flush=True)
        try:
            urllib.request.urlretrieve(SHAKESPEARE_URL, path + ".part")
        except OSError as e:                         # no network (URLError is an OSError)
            raise ValueError(f"cannot download {SHAKESPEARE_URL} ({e}); without internet use --input FILES") from None
        os.replace(path + ".part", path)
    return prepare_text_files([path], out_dir, tokenizer)


def ensure_dataset(data_dir):
    """Make sure data_dir holds a prepared dataset (ours, or nanoGPT's with meta.pkl); the default corpus is
    prepared on first use."""
    if any(os.path.exists(os.path.join(data_dir, name)) for name in ("meta.json", "meta.pkl")):
        return
    if os.path.normpath(data_dir) == os.path.normpath(DEFAULT_DATA_DIR):
        prepare_stdlib(data_dir)
        return
    raise FileNotFoundError(f"no dataset in {data_dir!r} (expected train.bin, val.bin, meta.json); "
                            f"prepare one with `python -m common.data --out_dir {data_dir}`")


# ----------------------------------------------------------------------------------------------------------
# reading a prepared directory: every problem is one error naming the file

class PlainUnpickler(pickle.Unpickler):
    """nanoGPT's meta.pkl holds dicts, strings and ints only: refuse anything that would import code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, not plain data")


def read_meta(data_dir):
    """(meta, the file it came from): meta.json, or the meta.pkl of a directory nanoGPT prepared (vocab_size,
    and for character-level data the id -> character table `itos`, which then completes a meta.json too)."""
    json_path, pkl_path = os.path.join(data_dir, "meta.json"), os.path.join(data_dir, "meta.pkl")
    meta, path = {}, json_path if os.path.exists(json_path) else pkl_path
    if os.path.exists(pkl_path):
        try:
            with open(pkl_path, "rb") as f:
                meta = {k: v for k, v in PlainUnpickler(f).load().items() if k in ("vocab_size", "itos")}
        except Exception as e:          # truncated, not a pickle, or not a dict: several kinds
            raise ValueError(f"{pkl_path} is not a readable nanoGPT meta.pkl ({type(e).__name__}: {e})") from None
    if path == json_path:
        if not os.path.isfile(json_path):
            raise ValueError(f"{json_path}: {not_a_file(json_path)}")
        try:
            with open(json_path) as f:
                loaded = json.load(f)
        except ValueError as e:         # not JSON, not UTF-8
            raise ValueError(f"{json_path} is not valid JSON ({e})") from None
        except OSError as e:
            raise ValueError(f"{json_path}: cannot read it ({e.strerror or e})") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{json_path} is not a JSON object")
        meta.update(loaded)
    vocab = meta.get("vocab_size")
    if type(vocab) is not int or not 0 < vocab <= 2 ** 16:          # (true is an int to Python)
        raise ValueError(f"{path} needs vocab_size, an integer in 1..65536 (token ids are uint16), got {vocab!r}")
    return meta, path


def open_tokens(path):
    """A .bin file as a read-only uint16 memmap."""
    if not os.path.isfile(path):        # (a pipe would block here for ever)
        raise ValueError(f"{path}: {not_a_file(path)}")
    try:
        return np.memmap(path, dtype=np.uint16, mode="r")
    except ValueError as e:             # an empty file, or an odd number of bytes
        raise ValueError(f"{path}: {e} (a token file holds uint16 ids, 2 bytes each)") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None


def check_token_ids(path, tokens, vocab_size, meta_path, window=2 ** 20, windows=16):
    """Every token id < vocab_size, or the embedding lookup fails in the first forward. A file of up to 16M
    tokens is scanned whole; a larger one (a 17 GB OpenWebText train.bin takes a minute to read) in 16 evenly
    spaced windows, which is enough for what happens in practice: data of another tokenizer than meta says."""
    if len(tokens) <= window * windows:
        top = int(tokens.max())
    else:
        starts = np.linspace(0, len(tokens) - window, windows).astype(np.int64)
        top = max(int(tokens[s:s + window].max()) for s in starts)
    if top >= vocab_size:
        raise ValueError(f"{path} holds token id {top}, but {meta_path} says vocab_size {vocab_size}: the data and "
                         f"its meta come from different preparations")


def check_token_count(path, tokens, meta, split, meta_path):
    """The file holds as many tokens as its meta says it wrote (where it says: ours does, nanoGPT's does not): ids
    of another width (uint32 is twice the bytes, and its small ids read as valid uint16 ones) or a partial copy
    are found here, not trained on."""
    count = meta.get(f"{split}_tokens")
    if count is None:
        return
    if type(count) is not int or count < 0:
        raise ValueError(f"{meta_path}: {split}_tokens must be a count of tokens, got {count!r}")
    if count != len(tokens):
        raise ValueError(f"{path} holds {len(tokens):,} uint16 tokens, but {meta_path} says {split}_tokens "
                         f"{count:,}: ids of another width (uint32: twice the bytes), or a partial copy")


# ----------------------------------------------------------------------------------------------------------
# deterministic global batches

class GlobalBatchLoader:
    """The tokens of every optimizer step as a pure function of (seed, step).

    Global batch of step s: global_batch_size sequences of block_size+1 tokens starting at offsets drawn
    from numpy's generator seeded with (seed, s, split). Sequence i of the global batch belongs to
    dp rank i // (per_rank) and micro-step (i % per_rank) // micro_batch_size, where per_rank =
    global_batch_size / dp: a DP rank owns one contiguous slice, and walks it micro-batch by micro-batch.
    """

    def __init__(self, data_dir, block_size, global_batch_size, seed, device="cpu"):
        self.block_size, self.global_batch_size, self.seed = block_size, global_batch_size, seed
        self.data_dir = data_dir
        self.device = torch.device(device)
        self.meta, meta_path = read_meta(data_dir)
        self.data = {split: open_tokens(os.path.join(data_dir, f"{split}.bin")) for split in ("train", "val")}
        for split, arr in self.data.items():
            path = os.path.join(data_dir, f"{split}.bin")
            if len(arr) < block_size + 2:            # a sequence of block_size + 1 tokens from one of >= 2 offsets
                raise ValueError(f"{path} has {len(arr)} tokens; --block_size {block_size} needs at least "
                                 f"block_size + 2 = {block_size + 2}: a smaller --block_size, or more data")
            check_token_ids(path, arr, self.vocab_size, meta_path)
            check_token_count(path, arr, self.meta, split, meta_path)

    @property
    def vocab_size(self):
        return int(self.meta["vocab_size"])

    def global_batch_offsets(self, step, split="train"):
        rng = np.random.default_rng([self.seed, step, 0 if split == "train" else 1])
        return rng.integers(0, len(self.data[split]) - self.block_size - 1, size=self.global_batch_size)

    def micro_batch(self, step, micro_step, micro_batch_size, dp_rank=0, dp_size=1, split="train"):
        """(x, y) int64 [micro_batch_size, block_size]: this rank's micro-step slice of step's global batch."""
        mine = rank_slice(self.global_batch_size, micro_step, micro_batch_size, dp_rank, dp_size)
        offsets = self.global_batch_offsets(step, split)[mine]
        return inputs_and_targets([self.data[split]] * len(offsets), offsets, self.block_size, self.device,
                                  self.vocab_size)


def rank_slice(global_batch_size, micro_step, micro_batch_size, dp_rank, dp_size):
    """Which sequences of the global batch are this DP rank's micro-step (the layout rule of GlobalBatchLoader)."""
    start = dp_rank * (global_batch_size // dp_size) + micro_step * micro_batch_size
    return slice(start, start + micro_batch_size)


def inputs_and_targets(arrays, offsets, block_size, device, vocab_size):
    """(x, y) int64 [len(offsets), block_size] from sequence i = arrays[i][offsets[i]:][:block_size + 1]. A token
    file cut short under the run (reading past its end would kill the process with SIGBUS) or an id >= vocab_size
    in these tokens (check_token_ids samples a large file; the embedding would fail far from here) stops the run
    naming the file: a stat and a max over the batch, on the host."""
    for arr in {id(a): a for a in arrays}.values():
        if os.stat(arr.filename).st_size < arr.nbytes:
            fail(f"{arr.filename} is now {os.stat(arr.filename).st_size:,} bytes, shorter than the "
                 f"{arr.nbytes:,} it had when the run opened it: the corpus changed under the run", rank_local=True)
    seqs = np.stack([arr[o:o + block_size + 1].astype(np.int64) for arr, o in zip(arrays, offsets)])
    if seqs.size and seqs.max() >= vocab_size:
        i = int(np.argmax(seqs.max(axis=1)))
        fail(f"{arrays[i].filename} holds token id {int(seqs[i].max())} in tokens {int(offsets[i]):,}.."
             f"{int(offsets[i]) + block_size:,}, but the corpus's vocab_size is {vocab_size}: the data and "
             f"its meta come from different preparations", rank_local=True)
    seqs = torch.from_numpy(seqs)
    if device.type == "cuda":
        seqs = seqs.pin_memory().to(device, non_blocking=True)
    return seqs[:, :-1], seqs[:, 1:]


def main(argv=None):
    p = argparse.ArgumentParser(description="Prepare a dataset as train.bin / val.bin / meta.json.",
                                allow_abbrev=False)         # a prefix of a flag is not the flag
    p.add_argument("--out_dir", default=None, help="where to write (default data/stdlib, data/<name>)")
    p.add_argument("--input", nargs="+", default=None, help="text files to tokenize instead of the stdlib")
    p.add_argument("--shakespeare", action="store_true", help="download tiny-shakespeare (needs internet)")
    p.add_argument("--tokenizer", default="byte",
                   help="byte: raw bytes, vocab 256 (offline); gpt2: tiktoken BPE (downloads its file once); or a "
                        "directory holding a Hugging Face tokenizer.json (the tokenizers library, offline)")
    a = p.parse_args(argv)
    try:
        check_out_dir_arg(a.out_dir)
        if a.tokenizer not in ("byte", "gpt2"):
            from common.hf.tokenizer import hf_tokenizer
            hf_tokenizer(a.tokenizer)               # a readable tokenizer.json there, before any work
        if a.shakespeare and a.input:
            raise ValueError("--shakespeare and --input both name the text: pick one")
        if not (a.shakespeare or a.input) and a.tokenizer != "byte":
            raise ValueError("the default stdlib corpus is byte-level; use --input FILES with another --tokenizer")
        out_dir = a.out_dir or (os.path.join("data", "shakespeare") if a.shakespeare else
                                os.path.join("data", "custom") if a.input else DEFAULT_DATA_DIR)
        report_interrupts(kept=dataset_kept(out_dir))
        if a.shakespeare:
            meta = prepare_shakespeare(out_dir, a.tokenizer)
        elif a.input:
            meta = prepare_text_files(a.input, out_dir, a.tokenizer)
        else:
            meta = prepare_stdlib(out_dir)
    except (ValueError, OSError) as e:
        fail(str(e))
    print(json.dumps(meta, indent=1))


def check_out_dir_arg(out_dir):
    """--out_dir is a directory, or can be made one (not a file, nor under one)."""
    if out_dir is None:
        return
    if out_dir.strip() == "":
        raise ValueError("--out_dir must name a directory")
    existing = os.path.abspath(out_dir)
    while not os.path.exists(existing):
        if os.path.islink(existing):
            raise ValueError(f"--out_dir {out_dir}: {not_a_file(existing)}")
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--out_dir {out_dir}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out_dir {out_dir}: {existing} is not writable")


def dataset_kept(out_dir):
    """What a Ctrl-C while out_dir is prepared leaves there, in words (for errors.report_interrupts): the dataset it
    had, or the new one once its meta.json, renamed into place last, has been replaced."""
    from common.checkpoint.files import kept_words
    meta = os.path.join(out_dir, "meta.json")
    before = f"nothing in {out_dir} was changed" if os.path.exists(meta) else f"no dataset was written to {out_dir}"
    return kept_words(meta, f"{out_dir} holds the newly prepared dataset", before)


if __name__ == "__main__":
    main()
