"""
bench/gpu_rows.py: the rows of bench/gpu_check.py that measure inside one process on one GPU, each a subcommand
that writes its sub-rows as JSON (gpu_check turns them into table rows):

    python3 bench/gpu_rows.py matmul  OUT.json   # the GPU's own bf16 8192^3 matmul rate: the measured ceiling
    python3 bench/gpu_rows.py kernels OUT.json   # each Triton kernel forward+backward against its torch peer
    python3 bench/gpu_rows.py cp      OUT.json   # CP's block attention: ring / zigzag / allgather in one process
    python3 bench/gpu_rows.py syncs   OUT.json   # host syncs in a train_single step (torch.cuda.set_sync_debug_mode)
    python3 bench/gpu_rows.py timings | attention | fp8linear OUT.json   # bench/kernel_timings.py: CUDA-graph
                                                 # timings of the kernels and FP8 against their peers

A sub-row is {"name", "ok", "check", "speed"}: ok a bool, check what was compared (an error against its bound),
speed a time ratio against the peer (> 1: ours is faster). Errors are relative: max |got - want| / max |want|,
against a float32 reference, and a bf16 result is judged against the bf16 peer's own error (bf16 keeps 8 bits, so
two correct bf16 computations differ by ~1e-2 of the largest value): ok when ours <= 2 x the peer's + 1e-3.
"""
import json
import os
import shutil
import statistics
import sys
import warnings

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BF16 = torch.bfloat16
DEVICE = "cuda"         # every row runs on the GPU (a test runs the logic on CPU with this changed)
GPT2_SMALL = dict(B=16, T=1024, C=768, H=12, V=50304)     # the shapes train_single runs at in gpu_check


def time_ms(fn, reps=20, warmup=3):
    """Median milliseconds of fn() over reps runs, timed with CUDA events after warmup runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_err(got, want):
    want = want.float()
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------------------------------------
# 1. the matmul ceiling

def matmul(n=8192, reps=10):
    from common.peaks import gpu_peak_flops
    a, b = (torch.randn(n, n, device=DEVICE, dtype=BF16) for _ in range(2))
    ms = time_ms(lambda: a @ b, reps=reps)
    tflops = 2 * n ** 3 / (ms / 1e3) / 1e12
    peak = gpu_peak_flops(torch.cuda.get_device_name(0))
    share = "" if peak is None else f", {100 * tflops * 1e12 / peak:.0f}% of the datasheet's {peak / 1e12:.0f}"
    return dict(tflops=tflops, rows=[dict(name=f"bf16 matmul {n}^3", ok=True, check="-",
                                          speed=f"{tflops:.0f} TFLOP/s{share}")])


# ----------------------------------------------------------------------------------------------------------
# 3. the Triton kernels against their torch peers, forward + backward, at train_single's GPT-2-small shapes

def prepared(fn, inputs, grad=None):
    """A closure running fn on fresh leaf copies of inputs, then backward with `grad` (a fixed random output
    gradient when None): each call returns [output, *input grads]. The copies are made once, outside the timing."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    if grad is None:
        with torch.no_grad():
            shape = fn(*leaves).shape
        grad = torch.randn(shape, generator=torch.Generator(DEVICE).manual_seed(1), device=DEVICE) if shape else None

    def run():
        for t in leaves:
            t.grad = None
        out = fn(*leaves)
        out.backward(None if grad is None else grad.to(out.dtype))
        return [out.detach()] + [t.grad for t in leaves if t.requires_grad]
    return run


def kernel_cases():
    """(name, inputs, ours, peer): ours the Triton path, peer what model.py runs without --kernels triton."""
    from kernels import bias_dropout_add, bias_gelu, flash_attention, layer_norm, linear_cross_entropy
    s = GPT2_SMALL
    B, T, C, H, V = s["B"], s["T"], s["C"], s["H"], s["V"]
    g = torch.Generator(DEVICE).manual_seed(0)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=DEVICE) * scale

    rows = B * T
    return [
        ("layer_norm", [rand(rows, C), 1 + rand(C, scale=0.1), rand(C, scale=0.1)],
         lambda x, w, b: layer_norm(x, w, b, backend="triton"), lambda x, w, b: F.layer_norm(x, (C,), w, b)),
        ("bias_gelu", [rand(rows, 4 * C), rand(4 * C, scale=0.1)],
         lambda x, b: bias_gelu(x, b, backend="triton"), lambda x, b: F.gelu(x + b)),
        ("bias_dropout_add", [rand(rows, C), rand(C, scale=0.1), rand(rows, C)],
         lambda x, b, r: bias_dropout_add(x, b, r, 0.0, True, backend="triton"), lambda x, b, r: r + (x + b)),
        ("flash_attention (peer: SDPA)", [rand(B, H, T, C // H) for _ in range(3)],
         lambda q, k, v: flash_attention(q, k, v, True, backend="triton")[0],
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("linear_cross_entropy", [rand(rows, C), rand(V, C, scale=0.02), torch.randint(0, V, (rows,), device=DEVICE)],
         lambda h, w, t: linear_cross_entropy(h, w, t, backend="triton"),
         lambda h, w, t: F.cross_entropy((h @ w.t()).float(), t)),
    ]


def kernels():
    out = []
    for name, inputs, ours, peer in kernel_cases():
        bf = [t.to(BF16) if t.is_floating_point() else t for t in inputs]
        want = prepared(peer, inputs)()                          # float32 reference
        run_ours, run_peer = prepared(ours, bf), prepared(peer, bf)
        err_ours = max(rel_err(a, b) for a, b in zip(run_ours(), want))
        err_peer = max(rel_err(a, b) for a, b in zip(run_peer(), want))
        ms_ours, ms_peer = time_ms(run_ours), time_ms(run_peer)
        bound = 2 * err_peer + 1e-3
        out.append(dict(name=f"{name}, bf16 fwd+bwd", ok=err_ours <= bound,
                        check=f"err {err_ours:.1e} (torch {err_peer:.1e}, bound {bound:.1e})",
                        speed=f"{ms_peer / ms_ours:.2f}x torch ({ms_ours:.2f} vs {ms_peer:.2f} ms)"))
    return dict(rows=out)


# ----------------------------------------------------------------------------------------------------------
# 5. context parallelism's block attention: every rank's blocks of a layout, run one rank after another

def rank_inputs(layout, cp, r, q, k, v, dout):
    """What train_cp's rank r holds under `layout`, copied out of the whole q, k, v, dout [B, H, T, D] before any
    timing (a real rank holds its chunk already; the emulation's gathers are no part of its work): (positions,
    q_r, dout_r, [(kv positions, k, v, blocks)] of the K/V it attends to, in the order it receives them)."""
    from train_cp import allgather_blocks, local_positions, ring_step_blocks
    T = q.shape[-2]
    pos = local_positions(layout, T, cp, r, q.device)
    if layout == "allgather":             # the whole K/V in global order: the blocks' columns are positions
        held = [(torch.arange(T, device=q.device), allgather_blocks(layout, T, cp, r))]
    else:                                 # ring step s: the K/V of rank r - s
        held = [(local_positions(layout, T, cp, (r - s) % cp, q.device),
                 ring_step_blocks(layout, r, (r - s) % cp, len(pos))) for s in range(cp)]
    return pos, q[..., pos, :], dout[..., pos, :], [(p, k[..., p, :], v[..., p, :], b) for p, b in held]


def rank_attention(q_r, dout_r, held, kernel):
    """One rank's block attention, forward and backward, as train_cp runs it: each block merged by log-sum-exp,
    then the backward from the merged out and lse. Returns (out, dq, [(kv positions, dk, dv)])."""
    from train_cp import attend, attend_backward, new_accumulators
    out, lse = new_accumulators(q_r)
    for _, k_b, v_b, blocks in held:
        attend(q_r, k_b, v_b, blocks, out, lse, kernel)
    out = out.to(q_r.dtype)
    dq, kv_grads = new_accumulators(q_r)[0], []
    for kv_pos, k_b, v_b, blocks in held:
        for cols, dk, dv in attend_backward(dout_r, q_r, k_b, v_b, out, lse, blocks, kernel, dq):
            kv_grads.append((kv_pos[cols], dk, dv))
    return out, dq, kv_grads


def emulated_cp(layout, cp, q, k, v, dout, kernel):
    """(out, dq, dk, dv) of causal attention over q, k, v [B, H, T, D] computed as train_cp's `cp` ranks would
    under `layout`: each rank's queries against the K/V blocks it receives, merged by log-sum-exp, and the
    backward from the merged out and lse. No process group: the ranks run in turn on this GPU."""
    acc = torch.promote_types(q.dtype, torch.float32)
    out_full, grads = torch.empty_like(q), [torch.zeros(q.shape, dtype=acc, device=q.device) for _ in range(3)]
    for r in range(cp):
        pos, q_r, dout_r, held = rank_inputs(layout, cp, r, q, k, v, dout)
        out, dq, kv_grads = rank_attention(q_r, dout_r, held, kernel)
        for kv_pos, dk, dv in kv_grads:
            grads[1][..., kv_pos, :] += dk
            grads[2][..., kv_pos, :] += dv
        out_full[..., pos, :] = out
        grads[0][..., pos, :] = dq
    return [out_full] + grads


def slowest_rank_ms(layout, cp, q, k, v, dout, kernel):
    """Milliseconds of the slowest rank's block attention, each rank timed on its own from inputs prepared
    beforehand: in a CP step the ranks run at once, so the slowest sets the step's time."""
    ranks = [rank_inputs(layout, cp, r, q, k, v, dout)[1:] for r in range(cp)]
    return max(time_ms(lambda: rank_attention(*inputs, kernel), reps=5, warmup=1) for inputs in ranks)


def cp(T=8192, B=1, H=16, D=64):
    from kernels.attention_lse import fused_block_attention
    kernel = fused_block_attention(torch.device(DEVICE), BF16, D)
    g = torch.Generator(DEVICE).manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g, device=DEVICE) for _ in range(4))

    def whole(*qkv):
        return F.scaled_dot_product_attention(*qkv, is_causal=True)

    want = prepared(whole, [q, k, v], dout)()                   # float32, whole sequence
    bf = [t.to(BF16) for t in (q, k, v, dout)]
    run_sdpa = prepared(whole, bf[:3], bf[3])
    err_sdpa = max(rel_err(a, b) for a, b in zip(run_sdpa(), want))
    ms_sdpa = time_ms(run_sdpa, reps=10)
    rows = []
    for layout in ("ring", "zigzag", "allgather"):
        for n in (2, 4):
            got = emulated_cp(layout, n, *bf, kernel)
            err = max(rel_err(a, b) for a, b in zip(got, want))
            ms = slowest_rank_ms(layout, n, *bf, kernel)
            bound = 2 * err_sdpa + 1e-3
            # a rank's share of whole-sequence SDPA over its time: 1.0x is a split that loses nothing
            rows.append(dict(name=f"cp={n} {layout}, T={T}, {kernel[0].__name__}", ok=err <= bound,
                             check=f"err {err:.1e} (SDPA {err_sdpa:.1e}, bound {bound:.1e})",
                             speed=f"{ms_sdpa / n / ms:.2f}x whole-sequence SDPA / {n} (slowest of {n} ranks, "
                                   f"{ms:.2f} vs {ms_sdpa:.2f} ms)"))
    return dict(rows=rows)


# ----------------------------------------------------------------------------------------------------------
# 6. host syncs inside a training step, as CUDA itself reports them

LOGGED = ("float(loss_sum)", "float(grad_norm)", "step_ok", "router_metrics", "mean_over_group", "read_values")
# the logged scalars (train_single's read once per log interval, by read_values) and the non-finite guard
# (tests/test_step_syncs.py allows the same places on CPU)
SYNC_ARGV = ["--n_layer", "4", "--n_head", "12", "--n_embd", "768", "--block_size", "1024", "--global_batch_size",
             "16", "--micro_batch_size", "8", "--max_steps", "5", "--warmup_steps", "1", "--eval_interval", "0",
             "--sample_tokens", "0", "--log_interval", "3", "--dtype", "bfloat16", "--kernels", "torch"]


def repo_line():
    """The innermost line of the repository (bench/ excluded) on the Python stack: where a sync was asked for."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(ROOT + os.sep) and not path.startswith(os.path.join(ROOT, "bench")):
            import linecache
            return f"{os.path.relpath(path, ROOT)}:{frame.f_code.co_name}: {linecache.getline(path, frame.f_lineno).strip()}"
        frame = frame.f_back
    return "<outside the repository>"


def count_syncs(main, argv):
    """main(argv) with CUDA's sync debug mode on from the MetricsLogger's creation to its close: [(step, place)],
    the step being that of the training batch read last (a step's rows may be logged later)."""
    from common import data, metrics
    cls, events, step = metrics.MetricsLogger, [], [0]
    init, read_batch, close = cls.__init__, data.GlobalBatchLoader.micro_batch, cls.close

    def init_then_watch(self, *a, **kw):
        init(self, *a, **kw)
        torch.cuda.set_sync_debug_mode("warn")

    def read_and_count(self, batch_step, *a, **kw):
        if kw.get("split", "train") == "train":
            step[0] = batch_step
        return read_batch(self, batch_step, *a, **kw)

    def stop_then_close(self):
        close(self)
        torch.cuda.set_sync_debug_mode("default")

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            events.append((step[0], repo_line()))

    cls.__init__, cls.close, data.GlobalBatchLoader.micro_batch = init_then_watch, stop_then_close, read_and_count
    shown = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            main(argv)
    finally:
        cls.__init__, cls.close, data.GlobalBatchLoader.micro_batch = init, close, read_batch
        warnings.showwarning = shown
        torch.cuda.set_sync_debug_mode("default")
    return events


def syncs(out_dir):
    """Syncs of steady-state step 2, which logs nothing (log_interval 3), outside the logged scalars: 0 dense; MoE
    exactly one read per MoE block and forward (the rows per expert, which each expert's GEMM needs on the host),
    dropless and with a capacity."""
    import train_single
    n_layer, forwards = 4, 2            # SYNC_ARGV: 4 blocks, global batch 16 in micro-batches of 8
    rows = []
    for name, extra in (("dense", []), ("MoE dropless", ["--n_experts", "8", "--top_k", "2"]),
                        ("MoE capacity 1.0", ["--n_experts", "8", "--top_k", "2", "--capacity_factor", "1.0"])):
        run_dir = os.path.join(out_dir, "syncs-" + name.split()[-1].replace(".", ""))
        shutil.rmtree(run_dir, ignore_errors=True)              # a rerun's: a new run refuses an earlier one's
        events = count_syncs(train_single.main, SYNC_ARGV + extra + ["--out_dir", run_dir])
        steady = [place for s, place in events if s == 2]          # step 2: caches built, nothing first-time
        stray = [p for p in steady if not any(a in p for a in LOGGED)]
        allowed = n_layer * forwards if extra else 0
        places = sorted({p: stray.count(p) for p in stray}.items(), key=lambda kv: -kv[1])
        detail = "; ".join(f"{n}x {p}" for p, n in places[:4])
        rows.append(dict(name=f"train_single step, {name}", ok=len(stray) == allowed and (bool(extra) or not steady),
                         check=f"{len(stray)} syncs outside the logged scalars (expected {allowed}; "
                               f"{len(steady) - len(stray)} logged)" + (f": {detail}" if detail else ""), speed="-"))
    return dict(rows=rows)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    from kernel_timings import attention, fp8linear, timings
    rows = dict(matmul=matmul, kernels=kernels, cp=cp, syncs=syncs, timings=timings, attention=attention,
                fp8linear=fp8linear)
    if len(argv) != 2 or argv[0] not in rows:
        sys.exit(f"usage: python3 bench/gpu_rows.py {{{'|'.join(rows)}}} OUT.json")
    if not torch.cuda.is_available():
        sys.exit("gpu_rows: error: no CUDA GPU visible to torch")
    fn = rows[argv[0]]
    result = fn(os.path.dirname(os.path.abspath(argv[1]))) if argv[0] == "syncs" else fn()
    with open(argv[1], "w") as f:
        json.dump(result, f, indent=1)
    for row in result["rows"]:
        print(f"{row['name']}: {'ok' if row['ok'] else 'FAIL'} | {row['check']} | {row['speed']}")


if __name__ == "__main__":
    main()
