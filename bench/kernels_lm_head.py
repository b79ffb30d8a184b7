"""
bench/kernels_lm_head.py: the LM head + cross-entropy alone, fused (kernels.linear_cross_entropy) or unfused
(model.py's LMHead: full logits, then F.cross_entropy), forward + backward per step; writes metrics.jsonl in
the nanoscale format so bench/harness.py compares the two.

    python bench/kernels_lm_head.py --head fused   --tokens 4096 --n_embd 768 --vocab 50304 --out_dir OUT
    python bench/kernels_lm_head.py --head unfused --tokens 4096 --n_embd 768 --vocab 50304 --out_dir OUT

peak_mem_bytes here is what the step adds on top of the inputs: the process's peak resident set during the
steps minus its resident set just before them (h, W, targets and W.grad already allocated). On CPU glibc
returns freed large blocks to the OS, so this follows the live tensors; it is the head's working memory.
"""
import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels import linear_cross_entropy  # noqa: E402


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", choices=["fused", "unfused"], required=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--max_steps", type=int, default=5)
    p.add_argument("--backend", default="auto", help="kernel backend of the fused head")
    p.add_argument("--out_dir", required=True)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    h = torch.randn(args.tokens, args.n_embd, requires_grad=True)
    w = torch.empty(args.vocab, args.n_embd).normal_(0, 0.02).requires_grad_()   # no temporary copy
    t = torch.randint(0, args.vocab, (args.tokens,))
    w.grad, h.grad = torch.zeros_like(w), torch.zeros_like(h)     # both heads accumulate into these
    base = rss_bytes()
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "metrics.jsonl"), "w") as f:
        for step in range(args.max_steps):
            t0 = time.perf_counter()
            if args.head == "fused":
                loss = linear_cross_entropy(h, w, t, backend=args.backend)
            else:
                loss = F.cross_entropy(F.linear(h, w).float(), t)
            loss.backward()
            dt = time.perf_counter() - t0
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
            f.write(json.dumps(dict(step=step, loss=float(loss), lr=0.0, grad_norm=float(w.grad.norm()),
                                    tokens=(step + 1) * args.tokens, step_time_s=dt,
                                    tokens_per_s=args.tokens / dt, mfu=None, peak_mem_bytes=max(peak, 0),
                                    comm_bytes=0)) + "\n")
            print(f"{args.head} step {step}: loss {float(loss):.4f}, {dt:.2f} s, +{peak / 2**20:.0f} MiB",
                  flush=True)


if __name__ == "__main__":
    main()
