"""
data.py: prepare a corpus into nanoGPT-style .bin files, and serve deterministic global batches.

Preparation (run once; train scripts do it automatically for the default corpus):

    python data.py                                   # default: this Python's standard library, byte tokens
    python data.py --input my.txt --tokenizer gpt2   # any text files, GPT-2 BPE (tiktoken, needs internet once)
    python data.py --shakespeare                     # tiny-shakespeare download, byte tokens

Output in --out_dir (default data/stdlib): train.bin and val.bin (uint16 memmaps: every token id < 2^16,
so nanoGPT-prepared directories work unchanged via --data_dir) and meta.json (vocab_size, tokenizer,
source, token counts).

The default corpus needs no download and exists wherever Python does: the source code of the running
interpreter's standard library (~15-20 MB of text), tokenised as raw bytes (vocab 256).

Loading (README, "Parity"): the global batch of optimizer step s is a fixed function of (seed, s):
`global_batch_offsets` draws global_batch_size start offsets from a generator seeded by (seed, s). A DP rank's
micro-batch is a fixed slice of it (`micro_batch`), so every layout sees exactly the same tokens per step.
"""
import argparse
import json
import os
import socket
import sys
import sysconfig
import urllib.request

import numpy as np
import torch

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
    if tokenizer == "gpt2":
        import tiktoken
        try:
            enc = tiktoken.get_encoding("gpt2")
        except Exception as e:  # no network: tiktoken downloads its BPE file on first use
            sys.exit(f"error: tiktoken could not load the GPT-2 BPE file ({type(e).__name__}: {e}).\n"
                     f"It is downloaded on first use; without internet use --tokenizer byte.")
        ids = enc.encode_ordinary(text_bytes.decode("utf-8", errors="replace"))
        return np.array(ids, dtype=np.uint16), enc.n_vocab          # 50257 < 2^16
    raise ValueError(f"unknown tokenizer {tokenizer!r}; expected byte or gpt2")


def write_dataset(out_dir, tokens, vocab_size, tokenizer, source, val_fraction=0.1):
    """Split tokens (last val_fraction for validation) and write train.bin / val.bin / meta.json."""
    os.makedirs(out_dir, exist_ok=True)
    n_val = max(int(len(tokens) * val_fraction), 1)
    splits = {"train": tokens[:-n_val], "val": tokens[-n_val:]}
    for split, arr in splits.items():
        tmp = temporary_name(out_dir, f"{split}.bin")
        arr.astype(np.uint16).tofile(tmp)
        os.replace(tmp, os.path.join(out_dir, f"{split}.bin"))
    meta = dict(vocab_size=vocab_size, tokenizer=tokenizer, source=source,
                train_tokens=int(len(splits["train"])), val_tokens=int(len(splits["val"])))
    tmp = temporary_name(out_dir, "meta.json")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "meta.json"))   # last: a meta.json means the .bin files are complete
    return meta


def temporary_name(out_dir, name):
    """A temporary file name no other writer uses: nodes that share a filesystem may each prepare the same
    corpus at once (one writer per node); each writes its own file and renames it into place atomically, and
    as they write the same bytes, whichever rename lands last changes nothing."""
    return os.path.join(out_dir, f"{name}.{socket.gethostname()}.{os.getpid()}.tmp")


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


def prepare_text_files(paths, out_dir, tokenizer):
    text = b"\n".join(open(p, "rb").read() for p in paths)
    tokens, vocab = encode(text, tokenizer)
    return write_dataset(out_dir, tokens, vocab, tokenizer, ", ".join(paths))


def prepare_shakespeare(out_dir, tokenizer):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "input.txt")
    if not os.path.exists(path):
        print(f"data: downloading {SHAKESPEARE_URL}", flush=True)
        urllib.request.urlretrieve(SHAKESPEARE_URL, path)
    return prepare_text_files([path], out_dir, tokenizer)


def ensure_dataset(data_dir):
    """Make sure data_dir holds a prepared dataset; the default corpus is prepared on first use."""
    if os.path.exists(os.path.join(data_dir, "meta.json")):
        return
    if os.path.normpath(data_dir) == os.path.normpath(DEFAULT_DATA_DIR):
        prepare_stdlib(data_dir)
        return
    raise FileNotFoundError(f"no dataset in {data_dir!r} (expected train.bin, val.bin, meta.json); "
                            f"prepare one with `python data.py --out_dir {data_dir}`")


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
        self.device = torch.device(device)
        with open(os.path.join(data_dir, "meta.json")) as f:
            self.meta = json.load(f)
        self.data = {split: np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
                     for split in ("train", "val")}
        for split, arr in self.data.items():
            if len(arr) <= block_size + 1:
                raise ValueError(f"{split}.bin in {data_dir} has {len(arr)} tokens, fewer than block_size+1 "
                                 f"= {block_size + 1}")

    @property
    def vocab_size(self):
        return int(self.meta["vocab_size"])

    def global_batch_offsets(self, step, split="train"):
        rng = np.random.default_rng([self.seed, step, 0 if split == "train" else 1])
        return rng.integers(0, len(self.data[split]) - self.block_size - 1, size=self.global_batch_size)

    def micro_batch(self, step, micro_step, micro_batch_size, dp_rank=0, dp_size=1, split="train"):
        """(x, y) int64 [micro_batch_size, block_size]: this rank's micro-step slice of step's global batch."""
        per_rank = self.global_batch_size // dp_size
        start = dp_rank * per_rank + micro_step * micro_batch_size
        offsets = self.global_batch_offsets(step, split)[start:start + micro_batch_size]
        arr = self.data[split]
        seqs = np.stack([arr[o:o + self.block_size + 1].astype(np.int64) for o in offsets])
        seqs = torch.from_numpy(seqs)
        if self.device.type == "cuda":
            seqs = seqs.pin_memory().to(self.device, non_blocking=True)
        return seqs[:, :-1], seqs[:, 1:]


def main(argv=None):
    p = argparse.ArgumentParser(description="Prepare a dataset as train.bin / val.bin / meta.json.")
    p.add_argument("--out_dir", default=None, help="where to write (default data/stdlib, data/<name>)")
    p.add_argument("--input", nargs="+", default=None, help="text files to tokenize instead of the stdlib")
    p.add_argument("--shakespeare", action="store_true", help="download tiny-shakespeare (needs internet)")
    p.add_argument("--tokenizer", default="byte", choices=["byte", "gpt2"],
                   help="byte: raw bytes, vocab 256 (offline); gpt2: tiktoken BPE (downloads its file once)")
    a = p.parse_args(argv)
    if a.shakespeare:
        meta = prepare_shakespeare(a.out_dir or os.path.join("data", "shakespeare"), a.tokenizer)
    elif a.input:
        meta = prepare_text_files(a.input, a.out_dir or os.path.join("data", "custom"), a.tokenizer)
    else:
        if a.tokenizer != "byte":
            sys.exit("error: the default stdlib corpus is byte-level; use --input FILES with --tokenizer gpt2")
        meta = prepare_stdlib(a.out_dir or DEFAULT_DATA_DIR)
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
