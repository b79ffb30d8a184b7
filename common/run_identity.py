"""
run_identity.py: what defines a run besides its model: the flags every rank must share, and the corpus it reads,
known by its content wherever it lies (a copy at another path, a relative --data_dir read from another directory,
the corpus each node prepared for itself: the same corpus; another tokenizer or other text: another corpus).

Two checks use it, each once:
- at start, every rank compares its identity with rank 0's (nodes launched with different command lines, or
  each reading a corpus of its own) and all stop naming the first difference;
- on resume, the checkpoint's corpus (every source of a mixture, with its weight) must be this run's
  (common/checkpoint/compat.py): the step number is the data position only on the same data.
"""
import functools
import hashlib
import json
import os

import torch.distributed as dist

from common.data_mix import hash_files, parse_data_mix
from common.distributed import decision_group

CORPUS_FILES = ("meta.json", "meta.pkl", "tokenizer.json", "tokenizer_config.json", "gpt2.tiktoken")
TOKEN_FILES = ("train.bin", "val.bin")
SAMPLE = 2 ** 20        # bytes read from each end of a token file: its size and both ends tell corpora apart
# Flags that may differ by rank: paths a node sees its own way (the corpora are compared by content instead),
# and what each rank resolves from its own disk or device.
PER_RANK = ("device", "data_dir", "data_mix", "init_from", "resume")


@functools.lru_cache(maxsize=64)
def _fingerprint(path, stamp):
    digest = hash_files(hashlib.sha256(), path, CORPUS_FILES)
    for name in TOKEN_FILES:
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.isfile(file) else -1
        digest.update(f"{name}:{size}".encode())
        if size > 0:
            with open(file, "rb") as f:
                digest.update(f.read(SAMPLE))
                f.seek(max(0, size - SAMPLE))
                digest.update(f.read(SAMPLE))
    return digest.hexdigest()[:16]


def corpus_fingerprint(data_dir):
    """16 hex digits of a prepared corpus's content: its meta and tokenizer files, and each token file's size and
    first and last MiB. Read once per state of the directory (its files' sizes and times)."""
    path = os.path.realpath(data_dir)
    stamp = tuple((n, s.st_size, s.st_mtime_ns) for n in CORPUS_FILES + TOKEN_FILES
                  for s in [_stat(os.path.join(path, n))] if s is not None)
    return _fingerprint(path, stamp)


def _stat(path):
    try:
        return os.stat(path)
    except OSError:
        return None


def corpus_of(cfg):
    """The run's corpus: [{path (absolute), weight, fingerprint}], for --data_dir (weight 1) or each --data_mix
    source."""
    sources = parse_data_mix(cfg.data_mix) if cfg.data_mix else [(cfg.data_dir, 1.0)]
    return [dict(path=os.path.abspath(d), weight=float(w), fingerprint=corpus_fingerprint(d)) for d, w in sources]


def corpus_difference(saved, now):
    """Why a checkpoint's corpus (corpus_of at its save) is not this run's, or None: the sources compared by content
    and weight, in order; paths may differ."""
    key = [(s["fingerprint"], s["weight"]) for s in saved]
    if key == [(s["fingerprint"], s["weight"]) for s in now]:
        return None
    return (f"the checkpoint was trained on {describe(saved)}; this run reads {describe(now)}: another corpus by "
            f"content or weight, so the step number no longer names the same batches")


def describe(corpus):
    return " + ".join(f"{s['path']} (weight {s['weight']:g}, content {s['fingerprint']})" for s in corpus)


def identity(cfg):
    """What every rank of one run must share: every flag but PER_RANK's, and the corpus by content."""
    flags = {k: repr(v) for k, v in sorted(vars(cfg).items())
             if k not in PER_RANK and isinstance(v, (str, int, float, bool, tuple, list, type(None)))}
    flags["corpus"] = repr([(s["fingerprint"], s["weight"]) for s in corpus_of(cfg)])
    return flags


def ranks_disagree(cfg, env):
    """None if every rank's identity is rank 0's, else one line (the same on every rank) naming the first rank and
    flag that differ. One gather of a digest on the gloo decision group (a start-up check, not the training
    communicator's traffic); the identities themselves only when the digests differ."""
    if env.world_size == 1:
        return None
    mine = identity(cfg)
    digests = [None] * env.world_size
    dist.all_gather_object(digests, hashlib.sha256(json.dumps(mine).encode()).hexdigest(), group=decision_group())
    if all(d == digests[0] for d in digests):
        return None
    every = [None] * env.world_size
    dist.all_gather_object(every, mine, group=decision_group())
    rank = next(r for r, d in enumerate(digests) if d != digests[0])
    key = next(k for k in sorted(set(every[0]) | set(every[rank])) if every[0].get(k) != every[rank].get(k))
    what = "the corpus (by content)" if key == "corpus" else f"--{key}"
    return (f"rank {rank} differs from rank 0 in {what}: {every[rank].get(key)} vs {every[0].get(key)}; every rank "
            f"must run the same command on the same corpus (launch every node alike)")
