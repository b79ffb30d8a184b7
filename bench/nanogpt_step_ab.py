"""
bench/nanogpt_step_ab.py: nanoscale's model.py + optim.py against nanoGPT's model.py and its optimizer, one
training step at a time, alternating in one process. Where the whole-script comparison (bench/peer_nanogpt.py)
drifts by 10-30% between runs on a shared machine, this one sees both models under the same conditions step
after step, so it resolves differences of about 1%.

    NANOGPT_DIR=~/nanoGPT python bench/nanogpt_step_ab.py --n_layer 4 --n_head 4 --n_embd 128 \
        --block_size 64 --batch_size 12 --steps 300

Each step draws one random batch and runs it through both models (order alternating), timing
  fwd+bwd   forward, loss and backward only (the models);
  step      fwd+bwd, gradient clipping at 1.0, the AdamW step, zero_grad: what each train script does per step.
nanoGPT's optimizer is its own `configure_optimizers` (on CPU it does not ask for fused AdamW, so PyTorch runs
its per-tensor loop); ours is optim.configure_optimizer (fused on CPU and CUDA). The table gives the median
time per step and ours' speed relative to nanoGPT as the median of the per-step paired ratios. fp32, one thread
unless --threads says otherwise. Writes bench/results/NAME.md.
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.harness import machine_description  # noqa: E402
from common.config import Config  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from common.optim import clip_grad_norm, configure_optimizer  # noqa: E402


def load_nanogpt_model(nanogpt_dir):
    path = os.path.join(nanogpt_dir or "", "model.py")
    if not os.path.isfile(path):
        sys.exit(f"error: {path!r} not found: pass --nanogpt_dir (or set NANOGPT_DIR) to a nanoGPT checkout")
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(a, vocab=256):
    ng = load_nanogpt_model(a.nanogpt_dir)
    theirs = ng.GPT(ng.GPTConfig(block_size=a.block_size, vocab_size=vocab, n_layer=a.n_layer, n_head=a.n_head,
                                 n_embd=a.n_embd, dropout=0.0, bias=True))
    their_opt = theirs.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cpu")
    ours = GPT(GPTConfig(vocab_size=vocab, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head,
                         n_embd=a.n_embd))
    our_opt = configure_optimizer(ours.named_parameters(), Config(), "cpu")
    return (theirs, their_opt, torch.nn.utils.clip_grad_norm_), \
           (ours, our_opt, lambda params, c: clip_grad_norm([p.grad for p in params], c))


def timed(model, opt, clip, x, y, full_step):
    t = time.perf_counter()
    _, loss = model(x, y)
    loss.backward()
    if full_step:
        clip(list(model.parameters()), 1.0)
        opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt_dir", default=os.environ.get("NANOGPT_DIR"))
    for key, default in (("n_layer", 4), ("n_head", 4), ("n_embd", 128), ("block_size", 64), ("batch_size", 12),
                         ("steps", 300), ("warmup", 10), ("threads", 1)):
        p.add_argument(f"--{key}", type=int, default=default)
    p.add_argument("--name", default=None, help="results go to bench/results/NAME.md (default: no file)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    peers = dict(zip(("nanoGPT", "ours"), build(a)))
    times = {(label, kind): [] for label in peers for kind in ("fwd+bwd", "step")}
    for i in range(a.warmup + a.steps):
        x, y = (torch.randint(0, 256, (a.batch_size, a.block_size)) for _ in range(2))
        for kind in ("fwd+bwd", "step"):
            for label in (("nanoGPT", "ours") if i % 2 else ("ours", "nanoGPT")):
                times[label, kind].append(timed(*peers[label], x, y, kind == "step"))
    shape = f"L{a.n_layer} H{a.n_head} h{a.n_embd} T{a.block_size} B{a.batch_size}"
    lines = [f"### model.py + optim.py vs nanoGPT's model.py, one step at a time ({shape}, {a.threads} thread)", "",
             f"Machine: {machine_description()}. {a.steps} alternating steps after {a.warmup} warm-up; medians.", "",
             "| timed | nanoGPT ms | ours ms | ours' speed vs nanoGPT (median of paired ratios) |", "|---|---|---|---|"]
    for kind in ("fwd+bwd", "step"):
        theirs, ours = (times[label, kind][a.warmup:] for label in ("nanoGPT", "ours"))
        ratio = statistics.median(t / o for t, o in zip(theirs, ours))
        lines.append(f"| {kind} | {1e3 * statistics.median(theirs):.2f} | {1e3 * statistics.median(ours):.2f} | "
                     f"{ratio:.3f} |")
    print("\n".join(lines))
    if a.name:
        path = os.path.join(ROOT, "bench", "results", f"{a.name}.md")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"bench: wrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
