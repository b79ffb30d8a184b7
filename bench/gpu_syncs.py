"""
bench/gpu_syncs.py: the host syncs of a training micro-batch counted by CUDA itself, the GPU side of
tests/test_step_syncs.py (which counts them on CPU by reading the code). torch.cuda.set_sync_debug_mode("warn")
makes every synchronizing CUDA call warn (a device-to-host copy such as .item() or .tolist(), a stream or device
synchronize, and the ops that size their output from device values, such as nonzero and bincount). One forward
and backward of model.py's GPT in bf16 autocast, after one to warm up, must sync exactly:

    dense                          0
    MoE (dropless, and capacity)   one per MoE block: the rows per expert, which each expert's GEMM needs

    python bench/gpu_syncs.py        # one line per model, exit 1 if a count differs; on a machine without a GPU,
                                     # one line and exit 0
"""
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from common.routing import start_moe_training  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

SHAPE = dict(vocab_size=256, n_layer=2, n_head=4, n_embd=128, block_size=64)
MODELS = {"dense": {}, "MoE dropless": dict(n_experts=4, top_k=2),
          "MoE capacity 1.0": dict(n_experts=4, top_k=2, capacity_factor=1.0)}


def syncs_of_a_micro_batch(model, idx):
    """Synchronizing CUDA calls in one forward + backward (the second: the first may build caches)."""
    for attempt in range(2):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = model(idx[:, :-1], idx[:, 1:])
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return [w for w in seen if "synchroniz" in str(w.message)]


def main():
    if not torch.cuda.is_available():
        print("gpu_syncs: skipped: no CUDA GPU here (tests/test_step_syncs.py counts the same on CPU)")
        return 0
    failed = False
    idx = torch.randint(0, SHAPE["vocab_size"], (4, SHAPE["block_size"] + 1), device="cuda")
    for name, flags in MODELS.items():
        cfg = GPTConfig(**SHAPE, **flags)
        model = GPT(cfg).cuda().train()
        start_moe_training(model, idx.shape[0] * SHAPE["block_size"])   # as the train scripts do
        expected = sum(cfg.is_moe_block(i) for i in range(cfg.n_layer)) if flags else 0
        syncs = syncs_of_a_micro_batch(model, idx)
        ok = len(syncs) == expected
        failed |= not ok
        where = "; ".join(sorted({f"{w.filename}:{w.lineno}" for w in syncs}))
        print(f"gpu_syncs: {name}: {len(syncs)} sync(s) per micro-batch, expected {expected}: "
              f"{'ok' if ok else 'FAILED'}{' (' + where + ')' if where else ''}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
