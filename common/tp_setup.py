"""
tp_setup.py: what applying train_tp.py's tensor parallelism to a model needs besides its layers: the shapes a
TP degree requires of the model (check_tp, for train_tp and train_5d alike), and per-rank random streams for
the data that differs between TP ranks (RankRNG: dropout on my heads or my sequence chunk).
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from common.errors import check


def check_tp(cfg, tp, positions, what="block_size"):
    """The shapes tensor parallelism of degree tp needs, in any layout (train_tp.py, train_5d.py): the heads split
    over tp, and under --sp the positions of a sequence each rank holds (`what`: how they are named)."""
    check(cfg.n_head % tp == 0, f"n_head={cfg.n_head} is not divisible by tp={tp} (the heads, and so "
                                f"the MLP width, are split over the TP ranks)")
    check((cfg.ffn_hidden or 4 * cfg.n_embd) % tp == 0, f"--ffn_hidden {cfg.ffn_hidden} is not divisible by tp={tp}")
    # grouped-query attention: each rank keeps n_kv_head / tp key/value heads with the q heads that share them
    # (replicating a kv head over the ranks of its q heads, Megatron's way for tp > n_kv_head, is not built)
    check(not cfg.n_kv_head or cfg.n_kv_head % tp == 0, f"--n_kv_head {cfg.n_kv_head} is not divisible by tp={tp} "
          f"(the key/value heads are split over the TP ranks, each with the query heads that share it)")
    check(not cfg.sp or positions % tp == 0, f"--sp: sequence length {what}={positions} is not divisible by tp={tp}")
    if tp > 1 and cfg.fp8 == "blockwise":
        # each fused part of a shard (q, k, v; gate, up) whole 128-blocks, so that every scale block is one
        # device's: a block straddling two parts (the Llama family's narrower k, v or MLP) would mix rows one
        # device keeps in different blocks (converters/fp8_tp.py)
        kv, ffn = (cfg.n_kv_head or cfg.n_head) * (cfg.n_embd // cfg.n_head), cfg.ffn_hidden or 4 * cfg.n_embd
        for what, width in (("n_embd", cfg.n_embd), ("n_kv_head*head_dim", kv), ("ffn_hidden", ffn)):
            check(width // tp % 128 == 0, f"--fp8 blockwise with tp={tp} needs {what}/tp ({width}/{tp}) a multiple "
                                          f"of 128: its 128-wide scale blocks must not straddle TP shards")


class RankRNG(nn.Module):
    """Run a module (attention core, dropout) under this TP rank's own random stream, for data that differs per
    rank (my heads, my sequence chunk): seeded from the shared stream (the same on all TP ranks, replayed by
    recomputation) plus the rank. Dropout in replicated regions uses the shared stream: the same on every rank."""

    def __init__(self, module, group):
        super().__init__()
        self.module, self.group = module, group

    def forward(self, *args):
        seed = int(torch.randint(0, 2 ** 62, (1,)))
        # fork the stream of the device the data is on, not the one the model was built on: train_5d builds on
        # "meta", for which fork_rng forks nothing, and the seed below would leak into the shared stream
        device = args[0].device
        with torch.random.fork_rng([device] if device.type == "cuda" else [], device_type=device.type):
            torch.manual_seed(seed + dist.get_rank(self.group))
            return self.module(*args)
