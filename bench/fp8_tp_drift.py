"""
bench/fp8_tp_drift.py: how far FP8 under tensor parallelism drifts from the same recipe at tp 1, and how much of
that a 1e-7 perturbation does at tp 1 alone (docs/kernels.md, "Under tensor parallelism").

    python -m common.data                                       # the default corpus, once
    python bench/fp8_tp_drift.py --steps 8                      # each recipe: train_single vs train_5d tp 2 + SP
    python bench/fp8_tp_drift.py --steps 3 --n_embd 256         # wide enough for blockwise at tp 2

Part 1 runs train_single and train_5d (torchrun, 2 CPU ranks, tp 2 + SP) in float64 with each recipe and prints
the relative difference of the loss and grad norm per step. Part 2 builds the GPT at tp 1 twice from the same
seed, adds a relative perturbation of 1e-7 (about one fp32 rounding: what a split contraction's partial sums
change) to every FP8 GEMM's output in the second, and prints the step-0 loss and grad norm differences.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common.metrics import read_metrics  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "delayed", "blockwise")


def flags(args, recipe, out_dir):
    return ["--fp8", recipe, "--dtype", "float64", "--seed", "1", "--lr", "1e-2", "--min_lr", "3e-4",
            "--warmup_steps", "5", "--grad_clip", "1.0", "--block_size", "32", "--global_batch_size", "8",
            "--micro_batch_size", "2", "--n_layer", "2", "--n_head", "4", "--n_embd", str(args.n_embd),
            "--max_steps", str(args.steps), "--eval_interval", "0", "--sample_tokens", "0", "--device", "cpu",
            "--dropout", "0", "--data_dir", args.data_dir, "--out_dir", out_dir]


def drift(args, recipe, tmp):
    single, tp = os.path.join(tmp, f"single_{recipe}"), os.path.join(tmp, f"tp_{recipe}")
    subprocess.run([sys.executable, os.path.join(ROOT, "train_single.py")] + flags(args, recipe, single),
                   check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                    os.path.join(ROOT, "train_5d.py"), "--tp", "2", "--sp"] + flags(args, recipe, tp),
                   check=True, capture_output=True)
    for a, b in zip(read_metrics(single), read_metrics(tp)):
        rel = [abs(a[k] - b[k]) / abs(a[k]) for k in ("loss", "grad_norm")]
        print(f"| {recipe} | {a['step']} | {rel[0]:.1e} | {rel[1]:.1e} |", flush=True)


def perturbed_step0(args, recipe, noise):
    from kernels.fp8 import Float8Linear, convert_to_float8
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_embd=args.n_embd, block_size=32), seed=1).double()
    convert_to_float8(model, recipe)
    gen = torch.Generator().manual_seed(5)
    for m in model.modules():
        if isinstance(m, Float8Linear) and noise:
            m.register_forward_hook(lambda mod, a, y: y * (1 + noise * torch.randn(y.shape, generator=gen,
                                                                                   dtype=y.dtype)))
    x = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(3))
    _, loss = model(x, torch.roll(x, -1, 1))
    loss.backward()
    return float(loss.detach()), float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters())))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=32)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--data_dir", default=os.path.join(ROOT, "data", "stdlib"))
    args = p.parse_args()
    recipes = [r for r in args.recipes.split(",") if r != "blockwise" or args.n_embd % 256 == 0]
    print(f"part 1: train_5d tp 2 + SP vs train_single, float64, n_embd {args.n_embd}\n"
          "| recipe | step | loss rel. diff | grad norm rel. diff |\n|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in recipes:
            drift(args, recipe, tmp)
    print(f"\npart 2: tp 1, every FP8 GEMM output x (1 + 1e-7 N(0,1)), step 0, n_embd {args.n_embd}\n"
          "| recipe | loss rel. diff | grad norm rel. diff |\n|---|---|---|")
    for recipe in recipes:
        (l0, g0), (l1, g1) = perturbed_step0(args, recipe, 0.0), perturbed_step0(args, recipe, 1e-7)
        print(f"| {recipe} | {abs(l1 - l0) / l0:.1e} | {abs(g1 - g0) / g0:.1e} |", flush=True)


if __name__ == "__main__":
    main()
