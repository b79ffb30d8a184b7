"""ZeRO-3 with FP8 GEMMs (train_zero.py, converters/fp8_gather.py): every recipe at dp 2 against the same recipe in one
process, --fp8_all_gather against FP8 ZeRO-3 without it, delayed scaling's histories across a resume.

FP8 has no float64 parity with train_single's high-precision run; the reference is train_single with the same
recipe and the same micro-batches (2 sequences each). With a dynamic recipe (tensorwise, rowwise, blockwise) every
operand is quantized from the same values as there, micro-batch by micro-batch: the FP8 units are gathered in the
parameters' dtype, so only the order of the float64 gradient sums differs (~1e-16), too little to flip a quantized
value in these steps: 1e-9 (docs/kernels.md gives the general bound, FP8_STEP0 / FP8_STEP1). Delayed scaling keeps
an amax history per rank (its micro-batches' amaxes), so at dp 2 its reference is ZeRO-0 at dp 2 (1e-9), and
train_single within the bound."""
import shutil

import pytest
import torch

from distributed_helper import run_workers
from common.metrics import read_metrics
from test_tp_fused import FP8_STEP0, FP8_STEP1, RECIPES
from train_helpers import EXACT, assert_exact, curves, run_single, text_argv, tiny_argv

RUN = dict(max_steps=2, micro_batch_size=2)          # 2 micro-batches a rank a step at dp 2 (global batch 8)
GATHERED = ("tensorwise", "delayed", "blockwise")      # the recipes --fp8_all_gather takes


def _runs(rank, world, jobs):
    """train_zero.main per (argv, copy_to): after a run, rank 0 copies its out_dir to copy_to (a checkpoint to
    resume elsewhere)."""
    import torch.distributed as dist
    import train_zero
    for argv, copy_to in jobs:
        train_zero.main(argv)
        if copy_to and rank == 0:
            shutil.copytree(argv[argv.index("--out_dir") + 1], copy_to)
        dist.barrier()


def within_fp8_bound(ref, got):
    for step, bound in enumerate((FP8_STEP0, FP8_STEP1)):
        for i, what in enumerate(("loss", "grad_norm")):
            assert abs(got[i][step] - ref[i][step]) <= bound[what] * ref[i][step], (step, what, got, ref)


def packed_widths(n, itemsize):
    """Bytes a rank sends per FP8 all-gather of a block's unit, from the block's parameters in their order: per
    rank, its shard's FP8 weight values at 1 byte, the others at itemsize; the gather's width is the largest."""
    from model import GPT, GPTConfig
    with torch.device("meta"):
        block = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32)).transformer.h[0]
    fp8 = {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"}
    per_value = [1 if name in fp8 else itemsize for name, p in block.named_parameters() for _ in range(p.numel())]
    shard = -(-len(per_value) // n)
    return max(sum(per_value[r * shard: (r + 1) * shard]) for r in range(n)), len(per_value)


def all_gather_bytes(padded_root, n=2, grad_acc=2, b=8):
    """A step's bytes with --fp8_all_gather (float64, b = 8): each block's unit gathered before its forward and its
    backward, packed (n-1) x width, plus the all-reduce MAX of its 4 FP8 weights' fp32 amaxes (one a weight at
    n_embd 32, blockwise too: one 128 x 128 block); reduce-scattered once per micro-batch in full precision; the
    root unit as in ZeRO-3; the all-reduce of the squared gradient norm (a float64 scalar here)."""
    width, numel = packed_widths(n, b)
    padded = -(-numel // n) * n
    ring = (n - 1) / n
    per_block = 2 * grad_acc * ((n - 1) * width + 2 * ring * 4 * 4) + grad_acc * ring * padded * b
    return 2 * per_block + grad_acc * ring * padded_root * 3 * b + 2 * ring * b


def test_zero3_fp8_recipes_all_gather_and_resume(text_data, tmp_path):
    dirs = {name: str(tmp_path / name) for name in [f"z3_{r}" for r in RECIPES] + [f"ag_{r}" for r in GATHERED]
            + ["z0_delayed", "resumed", "copy"]}
    jobs = [(text_argv(text_data, dirs[f"z3_{r}"], zero_stage=3, fp8=r, **RUN), None) for r in RECIPES]
    jobs += [(text_argv(text_data, dirs["z0_delayed"], zero_stage=0, fp8="delayed", **RUN), None)]
    jobs += [(text_argv(text_data, dirs[f"ag_{r}"], zero_stage=3, fp8=r, fp8_all_gather=True, **RUN), None)
             for r in GATHERED]
    resumed = text_argv(text_data, dirs["resumed"], zero_stage=3, fp8="delayed", **RUN)
    jobs += [(resumed + ["--stop_step", "1"], dirs["copy"]), (resumed + ["--resume"], None)]
    run_workers(_runs, 2, args=(jobs,), timeout=900)

    for r in RECIPES:
        ref = run_single(text_argv(text_data, str(tmp_path / f"single_{r}"), fp8=r, **RUN), both_curves=True)[0]
        got = curves(dirs[f"z3_{r}"])
        within_fp8_bound(ref, got)
        assert_exact(curves(dirs["z0_delayed"]) if r == "delayed" else ref, got, rtol=EXACT)
    for r in GATHERED:
        assert curves(dirs[f"ag_{r}"]) == curves(dirs[f"z3_{r}"])          # bit for bit: the same quantized W
        padded_root = 256 * 32 + 2 * 32                                    # wte (vocab 256) + ln_f, even already
        for row in read_metrics(dirs[f"ag_{r}"]):
            assert row["comm_bytes"] == all_gather_bytes(padded_root), (r, row["comm_bytes"])
    # delayed's histories come back: the same world continues as the unbroken run; one process within the bound
    assert curves(dirs["resumed"]) == curves(dirs["z3_delayed"])
    run_single(text_argv(text_data, dirs["copy"], fp8="delayed", resume=True, **RUN))
    within_fp8_bound(curves(dirs["z3_delayed"]), curves(dirs["copy"]))


def _5d_runs(rank, world, argvs):
    import train_5d
    for argv in argvs:
        train_5d.main(argv)


def test_5d_zero3_fp8_layouts(text_data, tmp_path):
    """train_5d's ZeRO-3 with tensorwise FP8 GEMMs at (dp 2, tp 2 + SP), in the tensor-parallel layers, at
    (dp 2, pp 2) with 1f1b and zb1, and at (dp 2, ep 2), in the experts' Float8Linears: train_single's same recipe within the FP8 bound. An expert's input
    amax is over the tokens its rank receives from both dp ranks, not over one device's micro-batch (delayed's
    histories too: 1.8e-5 at step 0 here), so ep's exact reference is ZeRO-1 in the same layout (1e-9). With
    --fp8_all_gather the ep layout's losses are the same bit for bit."""
    from test_moe_layouts import MOE
    moe = dict(top_k=2, **MOE)
    run = dict(RUN, micro_batch_size=4)                # one micro-batch a dp rank: the fewest passes
    dirs = {name: str(tmp_path / name) for name in ("tp", "ep", "ep_zero1", "ep_ag", "single", "single_moe",
                                                     "pp_1f1b", "pp_zb1", "single_mb2")}
    pp = [text_argv(text_data, dirs[f"pp_{s}"], dp=2, pp=2, pp_schedule=s, zero_stage=3, fp8="tensorwise", **RUN)
          for s in ("1f1b", "zb1")]                   # 2 micro-batches a dp rank: 1F1B's pp 2 needs both
    run_workers(_5d_runs, 4, args=([text_argv(text_data, dirs["tp"], dp=2, tp=2, sp=True, zero_stage=3,
                                              fp8="tensorwise", **run)] + pp,), timeout=900)
    ep_runs = (("ep", dict(zero_stage=3)), ("ep_zero1", dict(zero_stage=1)),
               ("ep_ag", dict(zero_stage=3, fp8_all_gather=True)))
    run_workers(_5d_runs, 2, args=([text_argv(text_data, dirs[name], dp=2, ep=2, fp8="tensorwise", **flags, **moe,
                                              **run) for name, flags in ep_runs],), timeout=900)
    ref = run_single(text_argv(text_data, dirs["single"], fp8="tensorwise", **run), both_curves=True)[0]
    within_fp8_bound(ref, curves(dirs["tp"]))
    ref = run_single(text_argv(text_data, dirs["single_moe"], fp8="tensorwise", **moe, **run), both_curves=True)[0]
    within_fp8_bound(ref, curves(dirs["ep"]))
    assert_exact(curves(dirs["ep_zero1"]), curves(dirs["ep"]), rtol=EXACT)
    assert curves(dirs["ep_ag"]) == curves(dirs["ep"])     # experts' units over edp, dense ones over dp: FP8 too
    # (dp 2, pp 2): the stages' FP8 blocks gathered by ZeRO-3 in every F and B, and under zb1 the FP8 dW GEMM
    # in W (on B's quantized dy, after B freed the weights): 1F1B's losses, both train_single's within the bound
    ref = run_single(text_argv(text_data, dirs["single_mb2"], fp8="tensorwise", **RUN), both_curves=True)[0]
    within_fp8_bound(ref, curves(dirs["pp_1f1b"]))
    assert_exact(curves(dirs["pp_1f1b"]), curves(dirs["pp_zb1"]), rtol=EXACT)


def _runs_on_simulated_gpu(rank, world, jobs):
    """_runs with kernels/fp8.py on its H100 path: every _scaled_mm under CUDA's rules (tests/cuda_scaled_mm.py).
    Operands are cast by the torch reference, not the Triton kernels under the interpreter (minutes here):
    tests/test_fp8_ops.py shows both give the same values bit for bit."""
    import torch
    import cuda_scaled_mm
    import kernels.fp8 as fp8
    fp8.gemm_kind = cuda_scaled_mm.simulated_gpu("cuda_blocks")
    fp8.fused_cast = lambda t: False
    torch._scaled_mm = cuda_scaled_mm.cuda_rules_scaled_mm(native_blocks=True)
    _runs(rank, world, jobs)


def test_fp8_all_gather_under_cuda_rules(text_data, tmp_path):
    """On the GPU path (operands padded to CUDA's multiples of 16, native 1x128 block scales, _scaled_mm under
    CUDA's rules) the FP8-gathered weights are accepted and are the cast's bit for bit: the same losses as FP8 ZeRO-3
    without the all-gather (delayed's second step: scales from the history; recomputed in backward from the weights
    gathered again; blockwise at n_embd 128: several 128 x 128 blocks a weight, shards cutting them)."""
    flags = dict(tensorwise=dict(max_steps=2), delayed=dict(max_steps=2, recompute="full"),
                 blockwise=dict(max_steps=1, n_embd=128))
    argvs = {(r, ag): text_argv(text_data, str(tmp_path / f"{r}_{ag}"), zero_stage=3, fp8=r, fp8_all_gather=ag,
                                micro_batch_size=4, **flags[r])
             for r in GATHERED for ag in (False, True)}
    run_workers(_runs_on_simulated_gpu, 2, args=([(argv, None) for argv in argvs.values()],), timeout=900)
    for r in GATHERED:
        assert curves(str(tmp_path / f"{r}_True")) == curves(str(tmp_path / f"{r}_False"))


@pytest.mark.parametrize("flags, reason", [
    (dict(zero_stage=2, fp8="tensorwise"), "needs --zero_stage 3 and --fp8"),
    (dict(zero_stage=3), "needs --zero_stage 3 and --fp8"),
    (dict(zero_stage=3, fp8="rowwise"), "two FP8 encodings of W"),
])
def test_fp8_all_gather_refusals(flags, reason, tiny_data, tmp_path, capsys):
    import train_zero
    with pytest.raises(SystemExit) as e:
        train_zero.main(tiny_argv(tiny_data, str(tmp_path), fp8_all_gather=True, **flags))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("error:") == 1 and reason in err, err


def test_fp8_all_gather_under_bf16_autocast(tiny_data, tmp_path):
    """Under bf16 autocast a unit's gather is launched without its fp32 buffer (given memory at wait(), where bf16 is
    widened into it): the FP8 gather, packed or whole in the parameters' dtype, fills the buffer all the same, and
    --fp8_all_gather gives FP8 ZeRO-3's losses without it (tensorwise: one scale a weight, from the whole weight)."""
    argvs = {ag: tiny_argv(tiny_data, str(tmp_path / f"ag_{ag}"), zero_stage=3, dtype="bfloat16", fp8="tensorwise",
                           fp8_all_gather=ag, max_steps=1, micro_batch_size=4) for ag in (False, True)}
    run_workers(_runs, 2, args=([(argv, None) for argv in argvs.values()],), timeout=300)
    assert curves(str(tmp_path / "ag_True")) == curves(str(tmp_path / "ag_False"))
