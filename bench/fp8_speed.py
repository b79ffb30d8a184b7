"""
bench/fp8_speed.py: does FP8 pay? train_single's tokens/s with each --fp8 recipe against bf16 (autocast), side by
side on one GPU, at a shape where the block GEMMs dominate the step (n_embd 4096: each Linear is a
[8192, 4096] x [4096, 4096+] GEMM, so quantization and scale traffic are small next to it).

    python bench/fp8_speed.py                       # bf16, tensorwise, rowwise, blockwise, delayed; 12 steps each
    python bench/fp8_speed.py --repeats 2 --recipes tensorwise,rowwise --n_embd 8192

Runs alternate (bf16, each recipe, then again for --repeats), each run's median tokens/s over its steps after
the first three (warm-up, Triton compiles); the table gives each recipe's median over repeats and its ratio to
bf16's. A GPU of compute capability >= 8.9 (FP8 tensor cores) is needed; elsewhere one line says so, exit 0.
"""
import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from gpu_check import run, summary, train_argv  # noqa: E402

SHAPE = dict(n_layer=4, n_head=32, n_embd=4096, block_size=1024, global_batch_size=8, micro_batch_size=8)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="tensorwise,rowwise,blockwise,delayed", help="comma-separated --fp8 recipes")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run (the first 3 are not timed)")
    p.add_argument("--repeats", type=int, default=1, help="alternating rounds of bf16 and every recipe")
    p.add_argument("--n_embd", type=int, default=SHAPE["n_embd"], help="model width (the GEMMs' K and N)")
    p.add_argument("--out", default=os.path.join("out", "fp8_speed"), help="run directories and table.md")
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("fp8_speed: skipped: needs a CUDA GPU of compute capability >= 8.9 (FP8 tensor cores)")
        return 0
    recipes = ["none"] + [r for r in args.recipes.split(",") if r]
    speeds = {recipe: [] for recipe in recipes}
    os.makedirs(args.out, exist_ok=True)
    for round_ in range(args.repeats):
        for recipe in recipes:
            out_dir = tempfile.mkdtemp(prefix=f"{recipe}_{round_}_", dir=args.out)
            flags = dict(SHAPE, n_embd=args.n_embd, fp8=recipe)
            rc = run([sys.executable, "train_single.py"] + train_argv(args.steps, out_dir, **flags),
                     os.path.join(out_dir, "log.txt"), 1800)
            if rc != 0:
                print(f"fp8_speed: --fp8 {recipe} failed ({rc}); see {out_dir}/log.txt")
                return 1
            speeds[recipe].append(summary(out_dir, skip=3)[1])
    base = sorted(speeds["none"])[len(speeds["none"]) // 2]
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, n_embd {args.n_embd}, "
             f"{args.repeats} round(s) of {args.steps} steps", "",
             "| --fp8 | tokens/s | vs bf16 |", "|---|---|---|"]
    for recipe in recipes:
        median = sorted(speeds[recipe])[len(speeds[recipe]) // 2]
        lines.append(f"| {'none (bf16)' if recipe == 'none' else recipe} | {median:,.0f} | {median / base:.2f}x |")
    print("\n".join(lines))
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
