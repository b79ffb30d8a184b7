"""
bench/model_state_5d.py: the model state per rank of the dp 2 x tp 2 runs of the 5d sweeps, counted from the
model's parameters, and the load the sweep ran under; appended to the sweep's table.

    python bench/model_state_5d.py --results bench/results/5d.md --load bench/runs/5d/loadavg.txt

fp32 weight + gradient + 2 AdamW moments per parameter of one tp rank: kept whole (replicas over dp), with the
moments sharded over dp (ZeRO-1), or all four sharded over dp (ZeRO-3, FSDP2). Both TP plans split c_attn, c_fc and
c_proj; train_tp's embedding is vocab-parallel, the DTensor peer's is replicated. The padding of a ZeRO unit to a
multiple of dp (fewer than dp values) is left out; so are the one or two gathered blocks ZeRO-3 and FSDP2 hold for
compute.
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.data import DEFAULT_DATA_DIR, ensure_dataset  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

TP_SPLIT = (".c_attn.weight", ".c_attn.bias", ".c_fc.weight", ".c_fc.bias", ".c_proj.weight")


def rows():
    """(label, parameters of one tp rank, fp32 values of model state per rank) at dp 2 x tp 2, L4 H4 h256 T128."""
    ensure_dataset(DEFAULT_DATA_DIR)          # the vocabulary of the default corpus (prepared once)
    vocab = json.load(open(os.path.join(DEFAULT_DATA_DIR, "meta.json")))["vocab_size"]
    with torch.device("meta"):
        gpt = GPT(GPTConfig(vocab_size=vocab, n_layer=4, n_head=4, n_embd=256, block_size=128))
    ours = sum(p.numel() // (2 if n.endswith(TP_SPLIT + ("wte.weight",)) else 1) for n, p in gpt.named_parameters())
    peer = sum(p.numel() // (2 if n.endswith(TP_SPLIT) else 1) for n, p in gpt.named_parameters())
    return [("5d dp2 tp2 (whole replica over dp)", ours, 4 * ours),
            ("5d dp2 tp2 ZeRO-1 (moments sharded over dp)", ours, 2 * ours + 2 * ours / 2),
            ("5d dp2 tp2 ZeRO-3 (all sharded over dp)", ours, 4 * ours / 2),
            ("FSDP2+DTensor dp2 tp2 (all sharded over dp, embedding replicated over tp)", peer, 4 * peer / 2)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", required=True, help="the sweep's markdown table, appended to")
    p.add_argument("--load", required=True, help="the 1-minute load averages sampled while the sweep ran")
    a = p.parse_args()
    lines = ["", "Model state per rank at dp2 x tp2, counted (fp32 weight + gradient + 2 AdamW moments; the gathered "
             "blocks of ZeRO-3 and FSDP2 not counted: bench/model_state_5d.py):", "",
             "| run | parameters of one tp rank (before any dp sharding) | model state per rank |", "|---|---|---|"]
    lines += [f"| {label} | {n:,} | {values * 4 / 2**20:.1f} MiB |" for label, n, values in rows()]
    load = [float(x) for x in open(a.load).read().split()]
    lines += ["", f"1-minute load average on the 2 cores while the sweep ran (sampled every 10 s): median "
              f"{statistics.median(load):.1f}, range {min(load):.1f}-{max(load):.1f}, the sweep's own ranks "
              f"included. Other work shared the machine, so these figures are indicative."]
    with open(a.results, "a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
