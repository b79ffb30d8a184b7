"""
bench/pa_offload_check.py: --offload_activations on one GPU (converters/partition_activations.py): the kept parts leave
the device and come back in time, and the gradients do not change.

    python bench/pa_offload_check.py                 # on a GPU: one rank, NCCL (a TP group of 1: the part is all)
    python bench/pa_offload_check.py --device cpu    # the same logic on CPU with gloo (no memory to compare)

A stack of model.py's blocks, on one rank, run three ways on the same input: torch's checkpoint per block (the plain
--recompute full), Pa, and Pa with offload. Asserted: the input gradient and every weight gradient of the three
agree (relative error <= 1e-5); on a GPU, the device memory allocated after the forward is lower with offload by
at least 90% of the kept parts (n_layer block inputs), which Pa without offload keeps (a group of 1 keeps the whole
input), and offload adds no host sync (torch.cuda.set_sync_debug_mode). Prints one line per check and exits 1 if any
fails.
"""
import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import model as M  # noqa: E402
from converters.partition_activations import partition_activations  # noqa: E402


def run(mode, device, n_layer, h, b, s):
    """(input grad, weight grads, bytes allocated after the forward, host syncs) of one forward and backward."""
    torch.manual_seed(0)
    cfg = M.GPTConfig(vocab_size=64, block_size=s, n_layer=n_layer, n_head=8, n_embd=h)
    blocks = torch.nn.ModuleList([M.Block(cfg) for _ in range(n_layer)]).to(device)
    if mode != "checkpoint":
        partition_activations(blocks, dist.group.WORLD, offload=mode == "pa offload")
    rope = M.rope_cache(h // 8, torch.arange(s, device=device))
    x = torch.randn(b, s, h, device=device, generator=torch.Generator(device).manual_seed(1)).requires_grad_()
    y = x
    with warnings.catch_warnings(record=True) as syncs:     # host syncs, on a GPU (set_sync_debug_mode)
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        for block in blocks:
            y = checkpoint(block, y, rope, use_reentrant=False) if mode == "checkpoint" else block(y, rope)
        held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        y.square().mean().backward()
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    return x.grad, [p.grad for p in blocks.parameters()], held, len(syncs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: no GPU here; `--device cpu` checks the same logic with gloo")
    device = torch.device(a.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="tcp://127.0.0.1:29533",
                            rank=0, world_size=1)
    n_layer, h, b, s = (8, 1024, 4, 2048) if device.type == "cuda" else (2, 64, 2, 32)
    results = {mode: run(mode, device, n_layer, h, b, s) for mode in ("checkpoint", "pa", "pa offload")}
    ok = True
    ref = results["checkpoint"]
    for mode in ("pa", "pa offload"):
        err = max(float((g - r).abs().max() / r.abs().max()) for g, r in zip([results[mode][0]] + results[mode][1],
                                                                          [ref[0]] + ref[1]))
        same = err <= 1e-5              # (a GPU's attention backward may sum in another order from run to run)
        print(f"{mode}: gradients {'equal' if same else 'DIFFER'} to the plain checkpoint's (max relative error "
              f"{err:.1e})")
        ok &= same
    if device.type == "cuda":
        parts = n_layer * b * s * h * 4
        saved = results["pa"][2] - results["pa offload"][2]
        fine = saved >= 0.9 * parts
        print(f"offload: {saved / 2 ** 20:,.1f} MiB less on the device after the forward (parts: "
              f"{parts / 2 ** 20:,.1f} MiB) {'ok' if fine else 'TOO LITTLE'}")
        ok &= fine
        quiet = results["pa offload"][3] <= results["pa"][3]
        print(f"offload: {results['pa offload'][3]} host syncs in forward + backward, Pa without it "
              f"{results['pa'][3]} {'ok' if quiet else 'MORE'}")
        ok &= quiet
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
