"""
bench/gpu_check_rows.py: the rows bench/gpu_check.py runs, in order of value, each with its command and an estimate
of its seconds on one H100-class GPU (process start, data, model set-up and the steps included; measured on an
H200, bench/results/gpu_check_h200.md; gpu_check scales them by how the rows so far compared with theirs). Also
the data the train rows read:

    python3 bench/gpu_check_rows.py data OUT     # OUT/data_gpt2vocab: the default corpus declared as vocab 50257
    python3 bench/gpu_check_rows.py plan h200    # plan.py's predicted peaks of the rows the plan-memory row compares

The train rows run GPT-2-small's shape (the vocabulary decides the LM head's size, a fifth of its FLOPs) on the
default corpus's byte tokens, so the loss falls as on real text (random tokens would sit at log(50257) and hide a
broken gradient), and nothing is downloaded.
"""
import dataclasses
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GPT2_VOCAB = 50257
GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, global_batch_size=16, micro_batch_size=16)
GEMM_BOUND = dict(n_layer=2, n_head=32, n_embd=4096, block_size=1024, global_batch_size=8, micro_batch_size=8)
GEMM_BOUND_8 = dict(GEMM_BOUND, n_layer=8)      # FP8's train rows: enough layers for the GEMMs to dominate
MOE = dict(n_experts=8, top_k=2)
RECIPES = ("rowwise", "tensorwise", "blockwise", "delayed")


@dataclasses.dataclass
class Row:
    name: str                 # short id: its log, run directory and JSON are named after it
    what: str                 # what it runs or measures, for the table
    est_s: float              # seconds on one H100-class GPU
    command: list             # argv, run from the repository root
    kind: str = "train"       # train (metrics.jsonl) | probe (gpu_rows.py JSON) | plan | tests
    ref: str = None           # train: the row whose losses this one's must match
    rtol: float = None        # ... within this relative gap
    speed_peer: str = None    # train: the row its tokens/s is shown against
    plan_flags: dict = None   # train: the flags plan.py predicts this run's peak memory from (row 7)


def data_dir(out):
    return os.path.join(out, "data_gpt2vocab")


def prepare_data(out):
    """The default corpus (prepared if missing) copied with vocab_size 50257 in its meta.json."""
    from common.data import DEFAULT_DATA_DIR, ensure_dataset
    os.chdir(ROOT)                 # the default corpus is prepared when asked for by its relative name
    ensure_dataset(DEFAULT_DATA_DIR)
    source = os.path.join(ROOT, DEFAULT_DATA_DIR)
    target = data_dir(out)
    os.makedirs(target, exist_ok=True)
    for split in ("train", "val"):
        shutil.copyfile(os.path.join(source, f"{split}.bin"), os.path.join(target, f"{split}.bin"))
    with open(os.path.join(source, "meta.json")) as f:
        meta = json.load(f)
    meta.update(vocab_size=GPT2_VOCAB, source=meta["source"] + " (byte ids, vocab declared as GPT-2's 50257)")
    with open(os.path.join(target, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


def train_command(script, out, name, steps, n_gpus=1, **flags):
    """argv of one training run: bf16, `steps` steps, no eval or sample, into out/name (gpu_check.py empties it
    before the run: a rerun of the check into the same OUT would otherwise be refused as another run's out_dir)."""
    args = dict(max_steps=steps, warmup_steps=2, lr=6e-4, min_lr=6e-5, dtype="bfloat16", seed=1234, eval_interval=0,
                sample_tokens=0, log_interval=max(1, steps // 2), dist_timeout=180, data_dir=data_dir(out),
                out_dir=os.path.join(out, name))
    args.update(flags)
    argv = []
    for key, value in args.items():
        argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    if n_gpus == 1 and script == "train_single.py":
        return [sys.executable, script] + argv
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n_gpus}", script] + argv


def probe_command(name, out):
    return [sys.executable, os.path.join("bench", "gpu_rows.py"), name.split("-")[0], os.path.join(out, f"{name}.json")]


def one_gpu_rows(out, steps, capability, bf16_rtol, fp8_rtol):
    rows = []

    def train(name, what, est_s, ref=None, rtol=None, speed_peer=None, plan=False, **flags):
        rows.append(Row(name, what, est_s, train_command("train_single.py", out, name, steps, **flags), "train", ref,
                        rtol, speed_peer, dict(flags) if plan else None))

    rows.append(Row("matmul", "bf16 8192^3 matmul (the measured ceiling)", 10, probe_command("matmul", out), "probe"))
    perf_rows(rows, train, out, capability, bf16_rtol, fp8_rtol)
    rows.append(Row("rates", "plan.py's rate table of this card: GEMM shapes, causal attention (OUT/rates/<card>.json; "
                    "copied to bench/results/rates/ it prices this card)", 30,
                    [sys.executable, os.path.join("bench", "gemm_rows.py"), "--measure", "--save", "--rates_dir",
                     os.path.join(out, "rates")], "tests"))
    train("single", "train_single GPT-2-small, eager", 20, kernels="torch", plan=True, **GPT2_SMALL)
    train("single-compile", "the same, --compile", 60, "single", bf16_rtol, "single", kernels="torch", compile=True,
          **GPT2_SMALL)
    rows.append(Row("kernels", "Triton kernels vs torch, GPT-2-small shapes", 30, probe_command("kernels", out),
                    "probe"))
    for mode in ("triton", "compile"):
        train(f"kernels-{mode}", f"train_single --kernels {mode}", 25 if mode == "triton" else 35, "single",
              bf16_rtol, "single", kernels=mode, **GPT2_SMALL)
    if capability >= (8, 9):                  # FP8 tensor cores: Ada and Hopper on
        train("gemm-bf16", "n_embd 4096 (GEMM-bound), bf16", 40, kernels="torch", plan=True, **GEMM_BOUND)
        for recipe in RECIPES:
            train(f"gemm-fp8-{recipe}", f"n_embd 4096 --fp8 {recipe}", 40, "gemm-bf16", fp8_rtol, "gemm-bf16",
                  kernels="torch", fp8=recipe, **GEMM_BOUND)
        for recipe in RECIPES:
            train(f"fp8-{recipe}", f"GPT-2-small --fp8 {recipe}", 15, "single", fp8_rtol, "single", kernels="torch",
                  fp8=recipe, **GPT2_SMALL)
    rows.append(Row("cp", "CP block attention, T 8192, emulated ranks", 10, probe_command("cp", out), "probe"))
    rows.append(Row("syncs", "host syncs in a step (set_sync_debug_mode)", 30, probe_command("syncs", out), "probe"))
    train("single-recompute", "train_single GPT-2-small --recompute full", 15, "single", bf16_rtol, "single",
          plan=True, kernels="torch", recompute="full", **GPT2_SMALL)
    rows.append(Row("plan-memory", "plan.py peak memory vs measured", 2, [], "plan"))   # reads rows 2 and 4's runs
    rows.append(Row("kernel-tests", "tests/test_kernels.py + test_fp8.py on the GPU", 600,
                    [sys.executable, "-m", "pytest", "-q", "-x", "tests/test_kernels.py", "tests/test_fp8.py"],
                    "tests"))
    return rows


def perf_rows(rows, train, out, capability, bf16_rtol, fp8_rtol):
    """Whether the kernels and FP8 make training faster (8 minutes of GPU time: bash bench/gpu_check.sh --only
    timings,attention,fp8linear,perf --budget_s 480), first in every run: the kernels and Float8Linear timed
    against their peers by CUDA-graph replays (bench/kernel_timings.py), then the train rows they should speed up,
    each after its baseline in the same run."""
    rows.append(Row("timings", "fused kernels vs eager / compiled torch, C 768 and 4096, CUDA graphs", 90,
                    probe_command("timings", out), "probe"))
    rows.append(Row("attention", "flash attention vs SDPA flash / cuDNN, T 1024 and 8192", 45,
                    probe_command("attention", out), "probe"))
    if capability >= (8, 9):
        rows.append(Row("fp8linear", "Float8Linear vs nn.Linear at 4 shapes, casts and GEMMs apart", 40,
                        probe_command("fp8linear", out), "probe"))
    train("perf-eager", "GPT-2-small eager (baseline)", 20, kernels="torch", **GPT2_SMALL)
    train("perf-triton", "GPT-2-small --kernels triton (fused head, attention, element-wise)", 25, "perf-eager",
          bf16_rtol, "perf-eager", kernels="triton", **GPT2_SMALL)
    train("perf-compile", "GPT-2-small --compile", 50, "perf-eager", bf16_rtol, "perf-eager", kernels="torch",
          compile=True, **GPT2_SMALL)
    if capability >= (8, 9):
        train("perf-gemm8-bf16", "n_embd 4096, 8 layers, --compile, bf16", 70, kernels="torch", compile=True,
              **GEMM_BOUND_8)
        for recipe in ("tensorwise", "rowwise"):
            train(f"perf-gemm8-fp8-{recipe}", f"the same --fp8 {recipe}", 70, "perf-gemm8-bf16", fp8_rtol,
                  "perf-gemm8-bf16", kernels="torch", compile=True, fp8=recipe, **GEMM_BOUND_8)
    # the next three run in a second call (480 s ends before them): each against perf-eager or perf-compile
    train("perf-head", "GPT-2-small eager with the fused LM head alone (--kernels head)", 20, "perf-eager",
          bf16_rtol, "perf-eager", kernels="head", **GPT2_SMALL)
    train("perf-sdpa-cudnn", "GPT-2-small eager, SDPA's cuDNN kernel (--sdpa cudnn; the baseline's auto: flash "
          "first)", 20, "perf-eager", bf16_rtol, "perf-eager", kernels="torch", sdpa="cudnn", **GPT2_SMALL)
    train("perf-compile-mb32", "GPT-2-small --compile, micro-batch 32", 70, speed_peer="perf-compile",
          kernels="torch", compile=True, **dict(GPT2_SMALL, micro_batch_size=32, global_batch_size=32))


def multi_gpu_rows(P, out, steps, capability, bf16_rtol, fp8_rtol):
    """Every train script under torchrun with NCCL at P GPUs (the small model of bench/gpu_check's earlier
    versions, so that every degree divides it), CP at T = 8192, the fused kernels and FP8 inside TP."""
    small = dict(n_layer=8, n_head=8, n_embd=512, block_size=256, global_batch_size=16, micro_batch_size=2)
    long = dict(small, block_size=8192, global_batch_size=4, micro_batch_size=1)
    rows = []

    def add(name, what, script, n, ref, rtol, est_s=60, **flags):
        rows.append(Row(name, what, est_s, train_command(script, out, name, steps, n, **flags), "train", ref, rtol))

    add("mg-single", "1 GPU reference, small model", "train_single.py", 1, None, None, 30, kernels="torch", **small)
    add("mg-single-moe", "1 GPU reference, 8 experts", "train_single.py", 1, None, None, 30, kernels="torch",
        **small, **MOE)
    add(f"ddp-{P}", f"dp={P}", "train_ddp.py", P, "mg-single", bf16_rtol, **small)
    for stage in (1, 2, 3):
        add(f"zero{stage}-{P}", f"dp={P} zero-{stage}", "train_zero.py", P, "mg-single", bf16_rtol, zero_stage=stage,
            **small)
    add(f"tp-{P}", f"tp={P}", "train_tp.py", P, "mg-single", bf16_rtol, tp=P, **small)
    add(f"tp-sp-{P}", f"tp={P} +sp", "train_tp.py", P, "mg-single", bf16_rtol, tp=P, sp=True, **small)
    add(f"cp-{P}", f"cp={P} zigzag", "train_cp.py", P, "mg-single", bf16_rtol, cp=P, cp_layout="zigzag", **small)
    add(f"pp-{P}", f"pp={P} 1f1b, sample through the stages", "train_pp.py", P, "mg-single", bf16_rtol, pp=P,
        pp_schedule="1f1b", **dict(small, sample_tokens=64))
    add(f"ep-{P}", f"ep={P}, 8 experts", "train_ep.py", P, "mg-single-moe", bf16_rtol, ep=P, **small, **MOE)
    add(f"5d-{P}", " ".join(f"{k}={v}" for k, v in grid_5d(P).items()), "train_5d.py", P, "mg-single", bf16_rtol,
        **grid_5d(P), **small)
    add("mg-single-long", "1 GPU, T=8192", "train_single.py", 1, None, None, 40, kernels="torch", **long)
    for layout in ("ring", "zigzag", "allgather"):
        add(f"cp-long-{layout}", f"cp={P} {layout}, T=8192", "train_cp.py", P, "mg-single-long", bf16_rtol, cp=P,
            cp_layout=layout, **long)
    add("mg-triton", "1 GPU --kernels triton", "train_single.py", 1, "mg-single", bf16_rtol, 40, kernels="triton",
        **small)
    add(f"tp-triton-{P}", f"tp={P} +sp --kernels triton", "train_tp.py", P, "mg-triton", bf16_rtol, tp=P, sp=True,
        kernels="triton", **small)
    for probe, what, est_s in (("stalled_save", f"rank {P - 1} stopped inside a save past --dist_timeout: latest "
                                                 "stays complete", 120),
                               ("startup", f"train_5d start-up at {P} ranks", 60)):
        name = f"{probe.replace('_', '-')}-{P}"
        rows.append(Row(name, what, est_s, [sys.executable, os.path.join("bench", "gpu_multi_rows.py"), probe, str(P),
                                            os.path.join(out, f"{name}.json")], "probe"))
    if capability >= (8, 9):
        add("mg-fp8", "1 GPU --fp8 tensorwise", "train_single.py", 1, "mg-single", fp8_rtol, 30, kernels="torch",
            fp8="tensorwise", **small)
        add(f"tp-fp8-{P}", f"tp={P} +sp --fp8 tensorwise", "train_tp.py", P, "mg-fp8", fp8_rtol, tp=P, sp=True,
            kernels="torch", fp8="tensorwise", **small)
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


def predicted_single_gpu_peak(flags, vocab_size, gpu):
    """plan.py's predicted peaks for train_single with these flags on one GPU (bf16 autocast), for the matching
    1-GPU layout: (allocated: the tensors and cuBLAS's workspaces, reserved: with the allocator's cache), both
    without the CUDA context, as torch.cuda.max_memory_allocated / max_memory_reserved count them. train_single
    keeps the logits through the backward (`_, loss = model(x, y)`) and sets its gradients to None after each step."""
    from dataclasses import replace
    from common.config import Config
    from plan import plan_job, rank_layouts
    cfg = Config(**{k: v for k, v in flags.items() if k not in ("kernels", "compile", "fp8")}, dtype="bfloat16")
    job = replace(plan_job(cfg, vocab_size, 1, 1, gpu, "amp"), logits_held=True, grads_freed=True)
    rows = [r for r in rank_layouts(job)
            if r["micro_batch_size"] == cfg.micro_batch_size and r["recompute"] == cfg.recompute]
    return rows[0]["mem_bytes"]["total"], rows[0]["mem_bytes"]["reserved"]


def print_plan_peaks(gpu):
    """The plan-memory row's predictions, without a GPU: each 1-GPU train row with plan_flags, on plan_inputs' `gpu`."""
    from planner.inputs import GIB
    for row in one_gpu_rows("/tmp", 6, (9, 0), 0.02, 0.05):
        if row.plan_flags is not None:
            allocated, reserved = predicted_single_gpu_peak(row.plan_flags, GPT2_VOCAB, gpu)
            print(f"{row.name}: allocated {allocated / GIB:.2f} GiB, reserved {reserved / GIB:.2f} GiB")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("data", "plan"):
        sys.exit("usage: python3 bench/gpu_check_rows.py data OUT | plan GPU")
    prepare_data(sys.argv[2]) if sys.argv[1] == "data" else print_plan_peaks(sys.argv[2])
