"""
bench/gpu_check.py: the one-command GPU check, run as `bash bench/gpu_check.sh` (which skips, exit 0, with one
line, only on a machine without a GPU, and fails with an error line when a GPU exists but python, a CUDA build of
torch or the driver is missing). On N >= 1 CUDA GPUs it runs, each for a few steps on the default corpus in
bf16 (autocast), with P = the largest power of two <= min(N, 8) so that every degree divides the test model:

  1. every train script (single, ddp, zero 1/2/3, tp (+sp), cp, pp, ep, and 5d when train_5d.py exists) under
     torchrun with NCCL at 1 GPU and at P GPUs, its loss at every step against train_single's within BF16_RTOL;
  2. train_single with --kernels triton / compile, and --fp8 with the fused kernels, against --kernels torch;
  3. train_single with each FP8 recipe against bf16 within FP8_RTOL (GPUs of compute capability >= 8.9), and
     FP8 with MoE experts;
  and on P > 1 GPUs: train_cp's three layouts at a long sequence (T = 8192) against train_single there, and
  train_pp's end-of-run sample run through the stages (no rank gathers the model);
  4. the kernel and FP8 tests (tests/test_kernels.py, tests/test_fp8.py), whose tensors live on the GPU;
then prints one markdown table (script, layout, ok, loss vs reference, tokens/s, MFU, peak memory, from each
run's metrics.jsonl via metrics.read_metrics) and writes it to OUT/table.md. Exit code 1 if any row failed.

    bash bench/gpu_check.sh                      # everything, 10 steps a run
    bash bench/gpu_check.sh --steps 30 --only tp,cp
    bash bench/gpu_check.sh --plan_sweep         # instead: plan.py's peak memory vs measured (bench/plan_sweep.py)
    python bench/gpu_check.py --plan_sweep --dry # the same sweep's layouts and predictions, without a GPU

Tolerances: bf16 keeps 8 significant bits, so two layouts that round and reduce in different orders drift
apart by ~1e-3 of the loss over a few steps; a lost micro-batch, a wrong gradient scale or a missed
all-reduce moves it by far more than BF16_RTOL. FP8 GEMMs add quantization noise on top (FP8_RTOL).
"""
import argparse
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from common.metrics import read_metrics  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))

BF16_RTOL = 2e-2     # max over steps of |loss - reference| / reference, bf16 runs
FP8_RTOL = 5e-2      # the same for FP8 runs against bf16
MODEL = dict(n_layer=8, n_head=8, n_embd=512, block_size=256, global_batch_size=16, micro_batch_size=2)
MOE = dict(n_experts=8, top_k=2)
LONG = dict(block_size=8192, global_batch_size=4, micro_batch_size=1)   # CP's case: [T, T] scores would be 256 MiB
                                                                         # per head in fp32


def train_argv(steps, out_dir, **flags):
    args = dict(MODEL, max_steps=steps, warmup_steps=2, lr=1e-3, min_lr=1e-4, dtype="bfloat16", seed=1234,
                eval_interval=0, sample_tokens=0, log_interval=max(1, steps // 2), dist_timeout=180, out_dir=out_dir)
    args.update(flags)
    argv = []
    for key, value in args.items():
        argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return argv


def launch(script, n_gpus):
    """train_single runs as a plain process; every other script under torchrun (NCCL even at 1 GPU)."""
    if script == "train_single.py":
        return [sys.executable, script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n_gpus}", script]


def runs(P, steps, out):
    """(name, layout, command, reference name, tolerance) for every row, references first."""
    rows = []

    def add(name, layout, script, n_gpus, ref, rtol, **flags):
        rows.append((name, layout, launch(script, n_gpus) + train_argv(steps, os.path.join(out, name), **flags),
                     ref, rtol))

    add("single", "1 GPU", "train_single.py", 1, None, None, kernels="torch")
    add("single-moe", "1 GPU, 8 experts", "train_single.py", 1, None, None, kernels="torch", **MOE)
    for n in sorted({1, P}):
        add(f"ddp-{n}", f"dp={n}", "train_ddp.py", n, "single", BF16_RTOL)
        for stage in (1, 2, 3):
            add(f"zero{stage}-{n}", f"dp={n} zero-{stage}", "train_zero.py", n, "single", BF16_RTOL, zero_stage=stage)
        add(f"tp-{n}", f"tp={n}", "train_tp.py", n, "single", BF16_RTOL, tp=n)
        add(f"tp-sp-{n}", f"tp={n} +sp", "train_tp.py", n, "single", BF16_RTOL, tp=n, sp=True)
        add(f"cp-{n}", f"cp={n} zigzag", "train_cp.py", n, "single", BF16_RTOL, cp=n, cp_layout="zigzag")
        add(f"pp-{n}", f"pp={n} 1f1b", "train_pp.py", n, "single", BF16_RTOL, pp=n, pp_schedule="1f1b")
        add(f"ep-{n}", f"ep={n}, 8 experts", "train_ep.py", n, "single-moe", BF16_RTOL, ep=n, **MOE)
        add(f"pp-sample-{n}", f"pp={n} 1f1b, sample through the stages", "train_pp.py", n, "single", BF16_RTOL,
            pp=n, pp_schedule="1f1b", sample_tokens=64)
        if os.path.exists(os.path.join(ROOT, "train_5d.py")):
            degrees = grid_5d(n)
            layout = " ".join(f"{k}={v}" for k, v in degrees.items())
            add(f"5d-{n}", layout, "train_5d.py", n, "single", BF16_RTOL, **degrees)
    if P > 1:     # CP where it matters: a long sequence, fused block attention (kernels/attention_lse.py)
        add("single-long", f"1 GPU, T={LONG['block_size']}", "train_single.py", 1, None, None, kernels="torch", **LONG)
        for layout in ("ring", "zigzag", "allgather"):
            add(f"cp-long-{layout}", f"cp={P} {layout}, T={LONG['block_size']}", "train_cp.py", P, "single-long",
                BF16_RTOL, cp=P, cp_layout=layout, **LONG)
    for mode in ("triton", "compile"):
        add(f"kernels-{mode}", f"1 GPU --kernels {mode}", "train_single.py", 1, "single", BF16_RTOL, kernels=mode)
    if P > 1:     # the fused kernels inside tensor-parallel layers
        add(f"tp-triton-{P}", f"tp={P} +sp --kernels triton", "train_tp.py", P, "kernels-triton", BF16_RTOL,
            tp=P, sp=True, kernels="triton")
    if torch.cuda.get_device_capability() >= (8, 9):
        for recipe in ("tensorwise", "rowwise", "blockwise", "delayed"):
            add(f"fp8-{recipe}", f"1 GPU --fp8 {recipe}", "train_single.py", 1, "single", FP8_RTOL,
                kernels="torch", fp8=recipe)
        add("fp8-triton", "1 GPU --fp8 tensorwise --kernels triton", "train_single.py", 1, "fp8-tensorwise",
            BF16_RTOL, kernels="triton", fp8="tensorwise")
        add("fp8-moe", "1 GPU, 8 experts --fp8 rowwise", "train_single.py", 1, "single-moe", FP8_RTOL,
            kernels="torch", fp8="rowwise", **MOE)     # experts get token counts that are not multiples of 16
        if P > 1:     # FP8 inside tensor-parallel layers: amaxes maxed over tp (kernels/fp8_parallel.py)
            add(f"tp-fp8-{P}", f"tp={P} +sp --fp8 tensorwise", "train_tp.py", P, "fp8-tensorwise", FP8_RTOL,
                tp=P, sp=True, kernels="torch", fp8="tensorwise")
    return rows


def grid_5d(n):
    """The largest layout n GPUs allow: factors of 2 dealt to tp, pp, dp, cp in turn (8 -> tp2 pp2 dp2)."""
    degrees = dict(tp=1, pp=1, dp=1, cp=1)
    axes = list(degrees)
    i = 0
    while n > 1:
        degrees[axes[i % 4]] *= 2
        n //= 2
        i += 1
    return degrees


def run(command, log_path, timeout_s):
    """Run one command in its own process group (so a hung rank can be killed with its siblings); rc."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout"


def summary(out_dir, skip):
    """(losses, median tokens/s, median MFU, peak memory bytes) of a finished run, steps < skip not timed."""
    rows = read_metrics(out_dir)
    timed = rows[skip:] or rows

    def median(key):
        values = sorted(r[key] for r in timed if r.get(key) is not None)
        return values[len(values) // 2] if values else None

    return [r["loss"] for r in rows], median("tokens_per_s"), median("mfu"), max(r["peak_mem_bytes"] for r in rows)


def loss_gap(losses, reference):
    if reference is None or len(losses) != len(reference):
        return None
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    p.add_argument("--out", default=os.path.join("out", "gpu_check"), help="run directories and table.md")
    p.add_argument("--timeout", type=int, default=900, help="seconds before a run counts as hung")
    p.add_argument("--only", default="", help="comma-separated name prefixes to run (references always run)")
    p.add_argument("--plan_sweep", action="store_true", help="instead of the checks: plan.py's predicted peak "
                   "memory and OOM vs torch.cuda.max_memory_allocated and max_memory_reserved over train_5d layouts "
                   "(bench/plan_sweep.py)")
    p.add_argument("--dry", action="store_true", help="with --plan_sweep: the layouts and predictions only")
    p.add_argument("--plan_gpus", type=int, default=8, help="with --dry and no GPU: GPUs to plan for")
    p.add_argument("--plan_gpu", default="h100", help="with --dry and no GPU: plan_inputs.HARDWARE's GPU")
    args = p.parse_args(argv)
    if args.plan_sweep:
        return plan_sweep_main(args)
    if not torch.cuda.is_available():       # run directly on a machine without a usable GPU: fail, never pass
        print("gpu_check: error: torch.cuda.is_available() is False (bash bench/gpu_check.sh says why)")
        return 1
    N = torch.cuda.device_count()
    P = 1 << (min(N, 8).bit_length() - 1)
    out = os.path.join(ROOT, args.out)
    os.makedirs(out, exist_ok=True)
    subprocess.run([sys.executable, "-c", "from common.data import ensure_dataset, DEFAULT_DATA_DIR; "
                    "ensure_dataset(DEFAULT_DATA_DIR)"], cwd=ROOT, check=True)
    machine = f"{N} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    print(f"gpu_check: {machine}; multi-GPU layouts on {P} GPUs; {args.steps} steps a run", flush=True)
    only = [s for s in args.only.split(",") if s]
    table, results, failed = [], {}, False
    for name, layout, command, ref, rtol in runs(P, args.steps, out):
        if only and ref is not None and not any(name.startswith(s) for s in only):
            continue
        t0 = time.time()
        rc = run(command, os.path.join(out, f"{name}.log"), args.timeout)
        gap, cells = None, ["-", "-", "-"]
        if rc == 0:
            losses, tok_s, mfu, mem = summary(os.path.join(out, name), skip=2)
            results[name] = losses
            gap = loss_gap(losses, results.get(ref)) if ref else None
            cells = [f"{tok_s:,.0f}", "n/a" if mfu is None else f"{100 * mfu:.1f}%", f"{mem / 2 ** 30:.2f} GiB"]
        verdict = verdict_of(rc, ref, gap, rtol)
        gap_text = "reference" if ref is None else ("-" if gap is None else f"{gap:.1e} (<= {rtol:g})")
        table.append([script_of(command), layout, verdict, gap_text, *cells])
        print(f"  {name:<16} {verdict:<12} {time.time() - t0:6.0f} s  (log: {os.path.join(args.out, name)}.log)",
              flush=True)
        failed |= verdict != "ok"
    rc = run([sys.executable, "-m", "pytest", "-q", "tests/test_kernels.py", "tests/test_fp8.py"],
             os.path.join(out, "kernel_tests.log"), args.timeout)
    table.append(["tests/test_kernels.py + test_fp8.py", "CUDA tensors", "ok" if rc == 0 else f"FAIL (rc {rc})",
                  "-", "-", "-", "-"])
    failed |= rc != 0
    lines = [f"GPU check on {machine} ({args.steps} steps a run, bf16; loss vs reference: max relative gap over "
             f"the steps)", "",
             "| script | layout | ok | loss vs reference | tokens/s | MFU | peak memory |",
             "|---|---|---|---|---|---|---|"] + ["| " + " | ".join(row) + " |" for row in table]
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


def plan_sweep_main(args):
    """--plan_sweep: on min(N, 8) CUDA GPUs (a power of two), or with --dry as if on --plan_gpus x --plan_gpu.
    Writes OUT/plan_sweep.md; the default corpus is byte-level, so the vocabulary is 256 without reading it."""
    from plan import gpu_kind
    from common.plan_inputs import HARDWARE
    from common.plan_memory import DEVICE_SHARE
    from plan_sweep import plan_sweep
    N = torch.cuda.device_count()
    if N == 0 and not args.dry:
        print("gpu_check --plan_sweep: no CUDA GPU here (use --dry to see the sweep)")
        return 0
    world = 1 << (min(N, 8).bit_length() - 1) if N else args.plan_gpus
    gpu = gpu_kind(torch.cuda.get_device_name(0)) if N else args.plan_gpu
    if gpu is None:
        print(f"gpu_check --plan_sweep: plan.py knows no GPU named {torch.cuda.get_device_name(0)!r}")
        return 1
    memory = torch.cuda.get_device_properties(0).total_memory if N else HARDWARE[gpu]["mem"] * DEVICE_SHARE
    lines = plan_sweep(world, gpu, memory, 256, os.path.join(ROOT, args.out), args.dry or not N)
    print("\n".join(lines))
    return 0


def verdict_of(rc, ref, gap, rtol):
    if rc != 0:
        return f"FAIL (exit {rc})"
    if ref is None:
        return "ok"
    if gap is None:
        return "FAIL (no reference)"
    return "ok" if gap <= rtol else "FAIL (loss)"


def script_of(command):
    return next(part for part in command if part.endswith(".py"))


if __name__ == "__main__":
    sys.exit(main())
