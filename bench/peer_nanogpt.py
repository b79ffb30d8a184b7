"""
bench/peer_nanogpt.py: run karpathy/nanoGPT's own train.py as the single-device peer of train_single.py and
write its per-step numbers as nanoscale metrics.jsonl rows, so bench/harness.py can put both side by side.

    python bench/peer_nanogpt.py --nanogpt_dir ~/nanoGPT --n_layer 4 --n_head 4 --n_embd 128 \
        --block_size 64 --global_batch_size 12 --micro_batch_size 12 --max_steps 20 --out_dir OUT

nanoGPT is not vendored here: --nanogpt_dir (or $NANOGPT_DIR) must be a checkout holding its train.py,
model.py and configurator.py. The wrapper makes a temporary working directory with
data/nanoscale/{train.bin,val.bin} (symlinks to nanoscale's prepared uint16 token files, the same format nanoGPT
reads) and a meta.pkl with the dataset's vocab_size (so nanoGPT builds the same 256-entry vocabulary instead of
its 50304 default), then runs nanoGPT's unmodified train.py there with the equivalent settings:
device=cpu, compile=False, dtype=float32, dropout 0, bias=True (our model has biases in every Linear and
LayerNorm), batch_size = micro batch, gradient_accumulation_steps = global / micro, the same lr schedule knobs,
log_interval=1, one evaluation of one batch at iteration 0 only (nanoGPT always evaluates at iteration 0; that
iteration falls in the harness's warm-up), no checkpoint saves, no wandb. With --eval_interval N > 0 (for a
loss comparison, not a timing) nanoGPT evaluates --eval_iters batches at every multiple of N up to and including
max_steps (it then runs max_steps + 1 iterations; the extra one is not reported), and each "step N: train loss X,
val loss Y" line becomes a {"step": N, "val_loss": Y} row, as train_single's log_eval writes them. nanoGPT
evaluates at iteration N before training it (after N steps), train_single at step N after it (after N + 1).

Each "iter N: loss X, time Yms" line becomes one row: step N, loss X (nanoGPT prints the last micro-batch's loss
times grad_acc, an approximation of the global mean), step_time_s = Y/1000, tokens_per_s = global_batch_size *
block_size / step_time_s, mfu computed exactly as train_single does (nanoscale's flops_per_token of the same
model shape / the machine's measured fp32 matmul peak at this thread count, peaks.machine_cpu_peak_flops),
peak_mem_bytes the nanoGPT process's lifetime peak RSS (resource.getrusage(RUSAGE_CHILDREN); train_single's rows
hold each step's peak, from after its set-up), comm_bytes 0. nanoGPT's dt is the period between
consecutive iterations (it includes fetching the next batch and the previous iteration's logging), train_single's
step_time_s is the step itself: both are per-step wall clocks of the training loop.

Differences in work that remain (small, real): nanoGPT adds learned position embeddings (a block_size x n_embd
table, wpe) to the token embeddings, while nanoscale's model.py applies RoPE to q and k in every layer; so
nanoGPT has block_size*n_embd more parameters and one embedding add, ours has the rotary multiply-adds on q, k.
nanoGPT also samples random batch offsets with torch.randint while ours reads deterministic ones.
On CPU nanoGPT's configure_optimizers does not ask for fused AdamW, so PyTorch steps it one tensor at a time;
optim.py asks for the fused kernel on CPU and CUDA (about 5x faster on CPU).
"""
import argparse
import json
import os
import pickle
import re
import resource
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.config import Config  # noqa: E402

ITER_LINE = re.compile(r"^iter (\d+): loss ([-+0-9.eEnaif]+), time ([0-9.]+)ms")
VAL_LINE = re.compile(r"^step (\d+): train loss [-+0-9.eEnaif]+, val loss ([-+0-9.eEnaif]+)")


def parse_args(argv=None):
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt_dir", default=os.environ.get("NANOGPT_DIR"),
                   help="a nanoGPT checkout (holding train.py); default $NANOGPT_DIR")
    for key in ("n_layer", "n_head", "n_embd", "block_size", "global_batch_size", "micro_batch_size",
                "max_steps", "warmup_steps", "eval_iters"):
        p.add_argument(f"--{key}", type=int, default=getattr(d, key))
    p.add_argument("--eval_interval", type=int, default=0,
                   help="evaluate every N iterations and at max_steps (0: only nanoGPT's own one at iteration 0)")
    for key in ("dropout", "lr", "min_lr", "weight_decay", "grad_clip"):
        p.add_argument(f"--{key}", type=float, default=getattr(d, key))
    p.add_argument("--data_dir", default=os.path.join(ROOT, d.data_dir))
    p.add_argument("--out_dir", required=True)
    p.add_argument("--keep_log", action="store_true", help="also copy nanoGPT's stdout to OUT/nanogpt.log")
    a = p.parse_args(argv)
    if not a.nanogpt_dir or not os.path.isfile(os.path.join(a.nanogpt_dir, "train.py")):
        p.error(f"--nanogpt_dir {a.nanogpt_dir!r} does not hold nanoGPT's train.py "
                "(clone https://github.com/karpathy/nanoGPT and pass its path, or set NANOGPT_DIR)")
    for f in ("model.py", "configurator.py"):
        if not os.path.isfile(os.path.join(a.nanogpt_dir, f)):
            p.error(f"--nanogpt_dir {a.nanogpt_dir!r} has train.py but no {f}: not a nanoGPT checkout")
    if a.global_batch_size % a.micro_batch_size:
        p.error(f"global_batch_size {a.global_batch_size} is not a multiple of micro_batch_size {a.micro_batch_size}")
    if a.max_steps < 1:
        p.error("--max_steps must be >= 1")
    return a


def make_workdir(a, tmp):
    """tmp/data/nanoscale/{train.bin,val.bin,meta.pkl} and tmp/configurator.py (train.py execs it from cwd)."""
    from common.data import ensure_dataset, read_meta
    if os.path.normpath(a.data_dir) == os.path.normpath(os.path.join(ROOT, Config().data_dir)):
        cwd = os.getcwd()
        os.chdir(ROOT)                       # the default corpus is prepared relative to the repo root
        try:
            ensure_dataset(Config().data_dir)
        finally:
            os.chdir(cwd)
    vocab_size = read_meta(a.data_dir)[0]["vocab_size"]     # meta.json, or a nanoGPT-prepared meta.pkl
    data = os.path.join(tmp, "data", "nanoscale")
    os.makedirs(data)
    for split in ("train", "val"):
        os.symlink(os.path.abspath(os.path.join(a.data_dir, f"{split}.bin")), os.path.join(data, f"{split}.bin"))
    with open(os.path.join(data, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": vocab_size}, f)
    os.symlink(os.path.abspath(os.path.join(a.nanogpt_dir, "configurator.py")), os.path.join(tmp, "configurator.py"))
    return vocab_size


def nanogpt_command(a, tmp):
    grad_acc = a.global_batch_size // a.micro_batch_size
    settings = dict(
        out_dir=os.path.join(tmp, "out"), dataset="nanoscale", device="cpu", compile=False, dtype="float32",
        n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, block_size=a.block_size, bias=True,
        dropout=float(a.dropout), batch_size=a.micro_batch_size, gradient_accumulation_steps=grad_acc,
        max_iters=a.max_steps - 1,          # nanoGPT runs iterations 0..max_iters inclusive
        learning_rate=float(a.lr), min_lr=float(a.min_lr), warmup_iters=a.warmup_steps,
        lr_decay_iters=max(a.max_steps, a.warmup_steps + 1), decay_lr=True,
        weight_decay=float(a.weight_decay), beta1=0.9, beta2=0.95, grad_clip=float(a.grad_clip),
        eval_interval=a.max_steps + 1, eval_iters=1, log_interval=1, always_save_checkpoint=False,
        wandb_log=False, init_from="scratch",
    )
    if a.eval_interval > 0:             # evaluate at iteration max_steps too, after max_steps steps
        settings.update(eval_interval=a.eval_interval, eval_iters=a.eval_iters, max_iters=a.max_steps)
    return [sys.executable, os.path.join(os.path.abspath(a.nanogpt_dir), "train.py")] + \
        [f"--{k}={v}" for k, v in settings.items()]


def parse_log(stdout, a, flops_per_token_over_peak, peak_mem):
    """nanoscale metrics rows from nanoGPT's stdout: one per "iter N" line below max_steps (the extra iteration an
    evaluation at max_steps needs is left out) and one {"step", "val_loss"} per evaluation line."""
    tokens_per_step = a.global_batch_size * a.block_size
    rows = []
    for line in stdout.splitlines():
        it = ITER_LINE.match(line.strip())
        val = VAL_LINE.match(line.strip())
        if val and a.eval_interval > 0:
            rows.append(dict(step=int(val.group(1)), val_loss=float(val.group(2))))
        if not it or int(it.group(1)) >= a.max_steps:
            continue
        step, loss, dt = int(it.group(1)), float(it.group(2)), float(it.group(3)) / 1000
        tps = tokens_per_step / dt
        rows.append(dict(step=step, loss=loss, lr=None, grad_norm=None, tokens=(step + 1) * tokens_per_step,
                         step_time_s=dt, tokens_per_s=tps, mfu=tps * flops_per_token_over_peak,
                         peak_mem_bytes=peak_mem, comm_bytes=0))
    return rows


def main(argv=None):
    a = parse_args(argv)
    import torch
    from common.peaks import machine_cpu_peak_flops
    from model import GPTConfig, flops_per_token

    os.makedirs(a.out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="peer_nanogpt_") as tmp:
        vocab_size = make_workdir(a, tmp)
        cmd = nanogpt_command(a, tmp)
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"peer_nanogpt: nanoGPT's train.py failed (exit {proc.returncode}):\n$ {' '.join(cmd)}\n"
                 f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    if a.keep_log:
        with open(os.path.join(a.out_dir, "nanogpt.log"), "w") as f:
            f.write(proc.stdout + proc.stderr)
    peak_mem = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024     # Linux reports KiB

    # MFU exactly as train_single computes it: same formula, same model shape, same measured peak
    fpt = flops_per_token(GPTConfig(vocab_size=vocab_size, block_size=a.block_size, n_layer=a.n_layer,
                                    n_head=a.n_head, n_embd=a.n_embd))
    peak_flops = machine_cpu_peak_flops()
    rows = parse_log(proc.stdout, a, fpt / peak_flops, peak_mem)
    train_rows = [r for r in rows if "loss" in r]
    if len(train_rows) != a.max_steps:
        sys.exit(f"peer_nanogpt: expected {a.max_steps} 'iter N: loss X, time Yms' lines from nanoGPT, "
                 f"parsed {len(train_rows)}:\n{proc.stdout[-2000:]}")
    with open(os.path.join(a.out_dir, "metrics.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tps = sorted(r["tokens_per_s"] for r in train_rows)
    print(f"peer_nanogpt: {len(train_rows)} steps, median {tps[len(tps) // 2]:,.0f} "
          f"tok/s (torch {torch.__version__}, {torch.get_num_threads()} threads) -> {a.out_dir}/metrics.jsonl")


if __name__ == "__main__":
    main()
