"""
data_mix.py: train on a weighted mixture of prepared corpora, as large runs do (--data_mix DIR:WEIGHT,...).

    python -m common.data_mix                      # prepare three corpora every Python ships (no download)
    python train_single.py --data_mix data/stdlib:0.6,data/docstrings:0.3,data/stdlib_text:0.1

GPT-3 (Brown et al. 2020, table 2.2) trained on Common Crawl 60%, WebText2 22%, Books1 8%, Books2 8% and
Wikipedia 3%: weights chosen by quality, not size, so over 300B tokens it saw Wikipedia 3.4 times and Common Crawl
0.44 times. A mixture run reports the same two numbers per source: tokens seen and epochs elapsed.

Each corpus keeps its own directory (train.bin, val.bin, meta.json, data.py) and its own tokenizer; the tokenizers
must agree, since an id must mean the same text in every source. The global batch of step s stays a fixed function
of (seed, s): one generator seeded by (seed, s, split) draws for each of the global_batch_size sequences its source
(by weight: the inverse CDF of a uniform) and then its start offset in that source. A DP rank's micro-batch is the
same slice of the global batch as with one corpus (data.rank_slice), so every layout sees the same tokens and
float64 parity holds with a mixture; the per-source counts are a function of (seed, s) too, so a resumed run counts
exactly what an unbroken one does. At each eval (training.evaluate) every source's val split is scored as well.
"""
if __name__ == "__main__":      # run as a script: from here on, torch's import included, a Ctrl-C is one line
    from common.errors import report_interrupts
    report_interrupts()
import argparse
import ast
import hashlib
import math
import os
import re
import sys

import numpy as np

from common.errors import check
from common.data import (DEFAULT_DATA_DIR, GlobalBatchLoader, encode, inputs_and_targets, rank_slice,
                         stdlib_text_files, write_dataset)

WEIGHT_TEXT = re.compile(r"\s*([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\s*")   # no sign, nan, inf, "1_0"
MIX_STREAM = 2          # a third generator key beside train (0) and val (1): mixture draws never reuse one-corpus ones


# ----------------------------------------------------------------------------------------------------------
# the flag

def parse_data_mix(text):
    """'DIR:WEIGHT,DIR:WEIGHT' -> [(dir, weight)], weights as given. ConfigError (one line) for a malformed entry,
    a weight that is negative, NaN or infinite, weights summing to zero, a directory named twice or missing."""
    sources = []
    for entry in text.split(","):
        directory, sep, weight = entry.strip().rpartition(":")
        check(sep and directory, f"--data_mix entry {entry.strip()!r}: expected DIR:WEIGHT")
        plain = WEIGHT_TEXT.fullmatch(weight) is not None
        check(plain and math.isfinite(float(weight)),
              f"--data_mix {directory}: the weight must be a finite number >= 0 in plain decimal digits, got "
              f"{weight!r}")
        value = float(weight)
        same = [d for d, _ in sources if os.path.realpath(d) == os.path.realpath(directory)]
        check(not same, f"--data_mix names {directory} twice" + (f" (as {same[0]})" if same and same[0] != directory
                                                                 else ""))
        check(os.path.isdir(directory) or os.path.normpath(directory) == os.path.normpath(DEFAULT_DATA_DIR),
              f"--data_mix {directory}: no such directory (prepare it with `python -m common.data_mix` or "
              f"`python -m common.data --out_dir {directory}`)")
        sources.append((directory, value))
    check(sum(w for _, w in sources) > 0, f"--data_mix: the weights sum to zero ({text})")
    return sources


def cumulative_weights(weights):
    """Normalized cumulative weights; the last is exactly 1.0 so every uniform in [0, 1) finds a source."""
    cum = np.cumsum(np.asarray(weights, dtype=np.float64) / sum(weights))
    cum[-1] = 1.0
    return cum


def draw_sources(rng, cum, n):
    """The source of each of n sequences, by weight (inverse CDF); a zero-weight source is never drawn."""
    return np.searchsorted(cum, rng.random(n), side="right")


def mixture_rng(seed, step, split):
    return np.random.default_rng([seed, step, 0 if split == "train" else 1, MIX_STREAM])


# ----------------------------------------------------------------------------------------------------------
# the loader: GlobalBatchLoader's interface, over several corpora

class MixtureLoader:
    """The tokens of every optimizer step as a pure function of (seed, step), drawn from weighted corpora."""

    def __init__(self, sources, block_size, global_batch_size, seed, device="cpu"):
        self.names = [d for d, _ in sources]
        self.cum = cumulative_weights([w for _, w in sources])
        self.block_size, self.global_batch_size, self.seed = block_size, global_batch_size, seed
        self.sources = [GlobalBatchLoader(d, block_size, global_batch_size, seed, device) for d in self.names]
        self.device = self.sources[0].device
        self.meta = self.sources[0].meta          # (decoding the sample: the tokenizers agree)
        check_tokenizers_agree(self.names, [s.meta for s in self.sources])

    @property
    def vocab_size(self):
        return self.sources[0].vocab_size

    def global_batch(self, step, split="train"):
        """(source index, start offset) of each sequence of step's global batch."""
        rng = mixture_rng(self.seed, step, split)
        which = draw_sources(rng, self.cum, self.global_batch_size)
        highs = np.array([len(s.data[split]) - self.block_size - 1 for s in self.sources])[which]
        return which, rng.integers(0, highs)

    def micro_batch(self, step, micro_step, micro_batch_size, dp_rank=0, dp_size=1, split="train"):
        """(x, y) int64 [micro_batch_size, block_size]: this rank's micro-step slice of step's global batch."""
        which, offsets = self.global_batch(step, split)
        mine = rank_slice(self.global_batch_size, micro_step, micro_batch_size, dp_rank, dp_size)
        arrays = [self.sources[k].data[split] for k in which[mine]]
        return inputs_and_targets(arrays, offsets[mine], self.block_size, self.device, self.vocab_size)


TOKENIZER_FILES = ("tokenizer.json", "gpt2.tiktoken")     # what data.py writes beside a corpus of those tokenizers


def hash_files(digest, directory, names):
    """digest fed with each of `names` that directory holds, its name then its bytes; returns digest."""
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest


def tokenizer_files_digest(directory):
    """A digest of the tokenizer files a corpus keeps (two Hugging Face tokenizers are both 'hf' in meta.json)."""
    return hash_files(hashlib.sha256(), directory, TOKENIZER_FILES).hexdigest()


def check_tokenizers_agree(names, metas):
    """Every source's tokenizer and vocabulary (and character table, nanoGPT's itos), and the content of its
    tokenizer files, are the first one's."""
    keys = ("tokenizer", "vocab_size", "itos", "files")
    metas = [dict(meta, files=tokenizer_files_digest(name)) for name, meta in zip(names, metas)]
    first = {k: metas[0].get(k) for k in keys}
    for name, meta in zip(names[1:], metas[1:]):
        differ = [k for k in keys if meta.get(k) != first[k]]
        if differ:
            k = differ[0]
            shown = {"itos": "a different table", "files": "another tokenizer.json by content"}.get(
                k, f"{meta.get(k)!r} vs {first[k]!r}")
            raise ValueError(f"--data_mix: {name} and {names[0]} disagree on {'tokenizer files' if k == 'files' else k} ({shown}): the sources of a "
                             f"mixture must share one tokenizer (prepare them with the same --tokenizer)")


# ----------------------------------------------------------------------------------------------------------
# what metrics.jsonl reports per source

class MixtureCounts:
    """Per source: the tokens trained on up to and including a step, and the epochs that makes of its train split.
    Recounted from step 0 on a resumed run's first step, so the numbers equal an unbroken run's."""

    def __init__(self, sources, seed, global_batch_size, block_size):
        self.names = [d for d, _ in sources]
        self.cum = cumulative_weights([w for _, w in sources])
        self.seed, self.global_batch_size, self.block_size = seed, global_batch_size, block_size
        self.train_tokens = [os.path.getsize(os.path.join(d, "train.bin")) // 2 for d in self.names]
        self.next_step, self.sequences = 0, np.zeros(len(self.names), dtype=np.int64)

    def step_sources(self, step):
        """Sequences of step's global batch from each source (the draw MixtureLoader makes, offsets aside)."""
        which = draw_sources(mixture_rng(self.seed, step, "train"), self.cum, self.global_batch_size)
        return np.bincount(which, minlength=len(self.names))

    def metrics(self, step):
        if step < self.next_step:               # (never in a run: steps only go forward)
            self.next_step, self.sequences[:] = 0, 0
        for s in range(self.next_step, step + 1):
            self.sequences += self.step_sources(s)
        self.next_step = step + 1
        tokens = [int(n) * self.block_size for n in self.sequences]
        return dict(tokens_by_source=dict(zip(self.names, tokens)),
                    epochs_by_source={n: t / max(size, 1) for n, t, size in zip(self.names, tokens, self.train_tokens)})


def source_val_losses(loss_fn, loader, cfg):
    """{source: mean validation loss over eval_iters micro-batches of that source alone} (training.evaluate)."""
    out = {}
    for name, source in zip(loader.names, loader.sources):
        losses = [float(loss_fn(*source.micro_batch(i, 0, cfg.micro_batch_size, split="val")))
                  for i in range(cfg.eval_iters)]
        out[name] = sum(losses) / len(losses)
    return out


# ----------------------------------------------------------------------------------------------------------
# three corpora every Python ships, for a mixture without a download

def stdlib_docstrings():
    """The docstrings of every module, class and function of the standard library, as one text."""
    _, files = stdlib_text_files()
    docs = []
    for path in files:
        try:
            with open(path, "rb") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, ValueError, OSError):     # test files written to be unparsable
            continue
        nodes = [tree] + [n for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        docs += [d for d in map(ast.get_docstring, nodes) if d]
    return "\n\n".join(docs).encode("utf-8", errors="replace")


def stdlib_plain_text():
    """The plain-text files (.txt, .rst) the standard library ships: licences, IDLE's help, test data."""
    root, _ = stdlib_text_files()
    chunks = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(f for f in filenames if f.endswith((".txt", ".rst"))):
            with open(os.path.join(dirpath, name), "rb") as f:
                chunks.append(f.read())
    return b"\n".join(chunks)


def prepare_docstrings(out_dir):
    return write_corpus(out_dir, stdlib_docstrings(), "docstrings")


def prepare_plain_text(out_dir):
    return write_corpus(out_dir, stdlib_plain_text(), "plain-text files")


def write_corpus(out_dir, text, what):
    tokens, vocab = encode(text, "byte")
    meta = write_dataset(out_dir, tokens, vocab, "byte", f"python {sys.version.split()[0]} stdlib {what}")
    print(f"data_mix: wrote {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens to {out_dir}",
          flush=True)
    return meta


def main(argv=None):
    p = argparse.ArgumentParser(description="Prepare the offline corpora of a mixture: the standard library's "
                                            "source, its docstrings and its plain-text files (byte tokens).",
                                allow_abbrev=False)
    p.add_argument("--out_dir", default="data", help="the corpora go to OUT_DIR/stdlib, OUT_DIR/docstrings and "
                                                     "OUT_DIR/stdlib_text (one prepared before is kept)")
    a = p.parse_args(argv)
    from common.data import check_out_dir_arg, dataset_kept, prepare_stdlib
    from common.errors import fail, report_interrupts
    try:
        check_out_dir_arg(a.out_dir)
        for name, prepare in (("stdlib", prepare_stdlib), ("docstrings", prepare_docstrings),
                              ("stdlib_text", prepare_plain_text)):
            out_dir = os.path.join(a.out_dir, name)
            if os.path.exists(os.path.join(out_dir, "meta.json")):          # prepared before (meta.json is last)
                print(f"data_mix: {out_dir} is prepared", flush=True)
            else:
                report_interrupts(kept=dataset_kept(out_dir))     # (the corpora before it stay prepared)
                prepare(out_dir)
    except (ValueError, OSError) as e:
        fail(str(e))


if __name__ == "__main__":
    main()
