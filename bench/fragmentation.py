"""
bench/fragmentation.py: what ZeRO-R's CB and MD (train_ddp.py's docstring) save the memory allocator, with and
without them, on one device.

    python bench/fragmentation.py                    # CPU: the process's peak resident memory per mode
    python bench/fragmentation.py --device cuda      # GPU: torch.cuda.memory_stats (allocated, reserved, inactive)

One training step's allocation pattern, replayed with plain tensors on a GPT-like stack of n_layer blocks (the
weights of model.py's block: 12 h^2 values), three steps in a row, each mode in a fresh process:

    forward   each block keeps an activation for backward and allocates and frees a short-lived temporary
    backward  block by block, in reverse: frees its activation, allocates an activation-gradient temporary, and
              produces the block's weight gradients:
                  without MD: a fresh tensor per weight, allocated between those temporaries
                  with MD:    written into views of flat buffers allocated once before the first step
    reduce    without CB: every gradient concatenated into one fused buffer (a temporary of all P values) and
                          copied back; with CB: in place, bucket by bucket (a --bucket_mb buffer each)
    step      without MD the gradients are freed (set_to_none), with MD the buffers are zeroed and kept

Reported: peak bytes allocated by tensors and peak bytes the allocator holds (CUDA: reserved; CPU: the process's
resident set, Linux's VmHWM, which includes the Python runtime), their difference (memory held but not in use:
fragmentation and cache), and on CUDA the peak of inactive split blocks (free pieces of partly used segments). The
table goes to bench/results/fragmentation_<device>.md.
"""
import argparse
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

MODES = {"none": dict(cb=False, md=False), "CB": dict(cb=True, md=False), "MD": dict(cb=False, md=True),
         "CB + MD": dict(cb=True, md=True)}
SIZES = dict(cpu=dict(n_layer=8, n_embd=512, tokens=2048), cuda=dict(n_layer=24, n_embd=2048, tokens=16384))


def block_shapes(h):
    """model.py's block weights: c_attn [3h, h], attn c_proj [h, h], c_fc [4h, h], mlp c_proj [h, 4h]."""
    return [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)]


def replay(device, n_layer, n_embd, tokens, cb, md, bucket_mb=25.0, steps=3):
    """The step pattern of the module docstring; returns the peaks the allocator reached."""
    from common.metrics import peak_memory_bytes, reset_peak_memory
    h, dev = n_embd, torch.device(device)
    shapes = [s for _ in range(n_layer) for s in block_shapes(h)]
    weights = [torch.randn(s, device=dev) * 0.02 for s in shapes]
    per_block = len(block_shapes(h))
    flat = views = None
    if md:                                           # gradients' home, made once (train_ddp's buckets)
        flat = torch.zeros(sum(w.numel() for w in weights), device=dev)
        views = [v.view(s) for v, s in zip(flat.split([w.numel() for w in weights]), shapes)]
    bucket = int(bucket_mb * 2 ** 20) // 4
    if dev.type == "cuda":
        torch.cuda.synchronize()
    reset_peak_memory(dev)
    for _ in range(steps):
        x, kept = torch.randn(tokens, h, device=dev), []
        for layer in range(n_layer):                 # forward: keep an input, make and drop a temporary
            temp = x @ weights[layer * per_block + 2].T                  # [tokens, 4h], short-lived
            x = x + (temp[:, :h] * 0.01)
            kept.append(x)
            del temp
        grads = [None] * len(weights)
        dx = torch.ones(tokens, h, device=dev)
        for layer in reversed(range(n_layer)):       # backward: free the activation, temporaries, weight grads
            act = kept.pop()
            temp = dx @ weights[layer * per_block + 3]                   # [tokens, 4h] activation-grad temporary
            for j in range(per_block):
                i = layer * per_block + j
                rows, cols = shapes[i]
                g = (temp[:, :rows].T @ act[:, :cols]) if cols == h else (temp[:, :rows].T @ temp[:, :cols])
                if md:
                    views[i].copy_(g)
                    grads[i] = views[i]
                else:
                    grads[i] = g.clone()                                 # a fresh tensor between temporaries
                del g
            dx = dx + temp[:, :h] * 0.01
            del temp, act
        if cb:                                        # in place, bucket by bucket
            whole = flat if md else None
            if whole is None:
                for g in grads:
                    g.mul_(0.5)
            else:
                for start in range(0, whole.numel(), bucket):
                    whole[start:start + bucket].mul_(0.5)
        else:                                         # one fused temporary of every gradient
            fused = torch.cat([g.reshape(-1) for g in grads]) * 0.5
            for g, part in zip(grads, fused.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
            del fused
        for w, g in zip(weights, grads):
            w.sub_(g, alpha=1e-3)
        if md:
            flat.zero_()
        del grads, dx, x
    if dev.type == "cuda":
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats(dev)
        return dict(allocated=stats["allocated_bytes.all.peak"], held=stats["reserved_bytes.all.peak"],
                    inactive=stats["inactive_split_bytes.all.peak"])
    return dict(allocated=None, held=peak_memory_bytes(dev), inactive=None)


def mib(n):
    return "n/a" if n is None else f"{n / 2 ** 20:,.1f}"


def write_table(rows, device, sizes, path):
    params = sizes["n_layer"] * 12 * sizes["n_embd"] ** 2
    lines = [f"# Allocator peaks with and without CB and MD ({device})", "",
             f"`python bench/fragmentation.py --device {device}`: {sizes['n_layer']} blocks of width "
             f"{sizes['n_embd']} ({params * 4 / 2 ** 20:,.0f} MiB of fp32 weights), {sizes['tokens']} tokens, 3 steps. "
             + ("CUDA's caching allocator (torch.cuda.memory_stats)." if device == "cuda" else
                "CPU: peak resident memory of the process (VmHWM, Python runtime included); glibc serves large "
                "blocks by mmap and returns them, so holes show less here than in CUDA's caching allocator."), "",
             "| mode | peak allocated MiB | peak held MiB | held - allocated MiB | peak inactive split MiB |",
             "|---|---|---|---|---|"]
    for mode, r in rows.items():
        spare = None if r["allocated"] is None else r["held"] - r["allocated"]
        lines.append(f"| {mode} | {mib(r['allocated'])} | {mib(r['held'])} | {mib(spare)} | {mib(r['inactive'])} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)          # one mode, in a fresh process
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: no GPU here (the CPU variant: leave out --device)")
    sizes = SIZES[a.device]
    if a.mode is not None:
        print(json.dumps(replay(a.device, **sizes, **MODES[a.mode])))
        return
    rows = {}
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--device", a.device, "--mode", mode], check=True,
                             capture_output=True, text=True).stdout
        rows[mode] = json.loads(out.strip().splitlines()[-1])
        print(mode, rows[mode], flush=True)
    os.makedirs(a.out, exist_ok=True)
    print("wrote", write_table(rows, a.device, sizes, os.path.join(a.out, f"fragmentation_{a.device}.md")))


if __name__ == "__main__":
    main()
