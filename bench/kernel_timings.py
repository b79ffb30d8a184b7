"""
bench/kernel_timings.py: the GPU check's timing probes for the fused kernels and FP8 (bench/gpu_rows.py's
`timings`, `attention` and `fp8linear` subcommands), each forward + backward in bf16:

    timings    layer_norm, bias_gelu, bias_dropout_add (p 0.1) at C 768 and 4096, and the fused LM head at
               GPT-2-small's shape, against torch eager and torch.compile of the same op
    attention  flash_attention at T 1024 / 8192, head dim 64 / 128, causal, against SDPA's flash and cuDNN
               backends; q, k, v and the output gradient in the model's [B, T, H, D] layout
    fp8linear  Float8Linear (tensorwise, rowwise) against nn.Linear under bf16 autocast at four (M, K, N), with
               the time of quantizing x, W and dy and the time of the three FP8 GEMMs given apart; and
               torch._dynamo.explain of a Float8Linear on the GPU (its Triton cast kernels in the graph)

Timing: each implementation's step (forward + backward, fresh gradients) runs 3 times to warm up (Triton's
autotuner, torch.compile, the allocator), is captured in a CUDA graph, and its replays are timed by two CUDA
events around 20 of them: no host sync or launch gap inside the measurement. A step that cannot be captured is
timed the same way from plain calls, and its row says so. Peak memory: torch.cuda.max_memory_allocated over one
step, above what was allocated before it. Errors as bench/gpu_rows.py's: against a float32 reference, ok when ours
<= 2 x the eager bf16 peer's + 1e-3.
"""
import torch
import torch.nn.functional as F

from gpu_rows import BF16, DEVICE, GPT2_SMALL, prepared, rel_err

MIB = 2 ** 20
REPS = 20
WIDTHS = (768, 4096)         # C of the element-wise rows: GPT-2-small's, and a GEMM-bound model's


def graph_timed(step, reps=REPS):
    """(ms per step, how): `step` captured in a CUDA graph after 3 warm-up runs on a side stream, its replays timed
    by CUDA events; 'graph' or 'launches' (capture failed: the step itself between the events)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    run, how = step, "launches"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run, how = graph.replay, "graph"
    except Exception:          # a step that syncs or allocates outside the pool: timed from plain launches
        torch.cuda.synchronize()
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps, how


def peak_mib(step):
    """MiB allocated at the peak of one step above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / MIB


def compared(name, inputs, ours, peers, check=None):
    """One sub-row: ours against peers {label: fn}, each in bf16 from the same inputs and timed; the errors of ours
    and of the first peer against the first peer in float32 (or of check = (ours', peer'), where the timed
    functions draw random numbers)."""
    bf = [t.to(BF16) if t.is_floating_point() else t for t in inputs]
    ours_check, peer_check = check or (ours, next(iter(peers.values())))
    want = prepared(peer_check, inputs)()
    errors = {label: max(rel_err(a, b) for a, b in zip(prepared(fn, bf)(), want))
              for label, fn in (("ours", ours_check), ("peer", peer_check))}
    runs = {"ours": prepared(ours, bf), **{label: prepared(fn, bf) for label, fn in peers.items()}}
    cells = []
    for label, run in runs.items():
        try:
            ms, how = graph_timed(run)
            cells.append((label, ms, how, peak_mib(run)))
        except Exception as e:          # a peer this build lacks (cuDNN attention): said, not fatal
            cells.append((label, None, f"{type(e).__name__}: {str(e)[:80]}", None))
    ours_ms = cells[0][1]
    speed = "; ".join(f"{label} {ms:.3f} ms ({how}), {mib:.0f} MiB" + (f", ours {ms / ours_ms:.2f}x" if
                                                                         label != "ours" else "")
                      if ms is not None else f"{label}: {how}" for label, ms, how, mib in cells)
    peer_err = errors["peer"]
    bound = 2 * peer_err + 1e-3
    return dict(name=f"{name}, bf16 fwd+bwd", ok=errors["ours"] <= bound,
                check=f"err {errors['ours']:.1e} (peer {peer_err:.1e}, bound {bound:.1e})", speed=speed,
                ms={label: ms for label, ms, _, _ in cells}, peak_mib={label: mib for label, _, _, mib in cells})


def _rand(g):
    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=DEVICE) * scale
    return rand


def timings():
    """The element-wise kernels at C 768 and 4096 and the LM head at GPT-2-small, vs eager and compiled torch."""
    from kernels import bias_dropout_add, bias_gelu, layer_norm, linear_cross_entropy
    rand, rows = _rand(torch.Generator(DEVICE).manual_seed(0)), GPT2_SMALL["B"] * GPT2_SMALL["T"]
    out = []
    for C in WIDTHS:
        M = rows * WIDTHS[0] // C          # the same bytes moved at every width
        cases = [
            ("layer_norm", [rand(M, C), 1 + rand(C, scale=0.1), rand(C, scale=0.1)],
             lambda x, w, b: layer_norm(x, w, b, backend="triton"),
             lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b)),
            ("bias_gelu", [rand(M, 4 * C), rand(4 * C, scale=0.1)],
             lambda x, b: bias_gelu(x, b, backend="triton"), lambda x, b: F.gelu(x + b)),
            ("bias_dropout_add p 0.1", [rand(M, C), rand(C, scale=0.1), rand(M, C)],
             lambda x, b, r: bias_dropout_add(x, b, r, 0.1, True, backend="triton"),
             lambda x, b, r: r + F.dropout(x + b, 0.1, True))]
        for name, inputs, ours, eager in cases:
            # random masks: dropout's error is checked at p 0, its time taken at p 0.1
            check = (lambda x, b, r: bias_dropout_add(x, b, r, 0.0, True, backend="triton"),
                     lambda x, b, r: r + x + b) if "dropout" in name else None
            out.append(compared(f"{name}, C {C}", inputs, ours, dict(eager=eager, compile=torch.compile(eager)),
                                check))
    V, C = GPT2_SMALL["V"], GPT2_SMALL["C"]

    def head(h, w, t):               # model.py's LMHead: F.linear, then the loss in fp32
        return F.cross_entropy(F.linear(h, w).float(), t)
    out.append(compared(f"linear_cross_entropy, {rows} tokens, V {V}",
                        [rand(rows, C), rand(V, C, scale=0.02), torch.randint(0, V, (rows,), device=DEVICE)],
                        lambda h, w, t: linear_cross_entropy(h, w, t, backend="triton"),
                        dict(eager=head, compile=torch.compile(head))))
    return dict(rows=out)


def attention():
    """flash_attention against SDPA's flash and cuDNN backends, inputs in the model's [B, T, H, D] layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels import flash_attention
    rand = _rand(torch.Generator(DEVICE).manual_seed(1))

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return run
    out = []
    for T, D in ((1024, 64), (8192, 128)):
        B, H = (16, 12) if T == 1024 else (1, 16)
        qkv = [rand(B, T, H, D).transpose(1, 2) for _ in range(3)]
        out.append(compared(f"flash_attention T {T}, D {D}, causal", qkv,
                            lambda q, k, v: flash_attention(q, k, v, True, backend="triton")[0],
                            dict(sdpa_flash=sdpa(SDPBackend.FLASH_ATTENTION),
                                 sdpa_cudnn=sdpa(SDPBackend.CUDNN_ATTENTION))))
    return dict(rows=out)


def fp8linear():
    """Float8Linear vs nn.Linear at four (M, K, N): forward + backward, then its cast and GEMM times apart."""
    import torch.nn as nn

    import kernels.fp8 as fp8
    from kernels.fp8_gemm import scaled_gemm
    rand = _rand(torch.Generator(DEVICE).manual_seed(2))
    out = []
    for M, K, N in ((1024, 2048, 1024), (16384, 768, 3072), (8192, 4096, 16384), (4096, 8192, 16384)):
        linear = nn.Linear(K, N, device=DEVICE)
        x, dy = rand(M, K), rand(M, N).to(BF16)
        ms_bf16 = graph_timed(_linear_step(linear, x, dy))[0]
        for recipe in ("tensorwise", "rowwise"):
            layer = fp8.Float8Linear.from_float(linear, recipe)
            ms, how = graph_timed(_linear_step(layer, x, dy))
            g = fp8.E4M3 if recipe == "rowwise" else fp8.E5M2
            kind = fp8.gemm_kind(x)

            def casts():
                return (fp8.cast(x.to(BF16), fp8.E4M3, recipe, "activation"),
                        fp8.cast(linear.weight, fp8.E4M3, recipe, "weight"), fp8.cast(dy, g, recipe, "activation"))
            qx, qw, qdy = casts()

            def gemms():
                scaled_gemm(qx[:2], qw[:2], BF16, recipe, kind, fast_accum=True)
                scaled_gemm(qdy[:2], qw[2:], BF16, recipe, kind)
                scaled_gemm(qdy[2:], qx[2:], torch.float32, recipe, kind)
            ms_cast, ms_gemm = graph_timed(casts)[0], graph_timed(gemms)[0]
            out.append(dict(name=f"Float8Linear {recipe}, M {M} K {K} N {N}", ok=True, check="-",
                            speed=f"{ms_bf16 / ms:.2f}x nn.Linear bf16 ({ms:.3f} vs {ms_bf16:.3f} ms, {how}); "
                                  f"casts {ms_cast:.3f} ms, 3 GEMMs {ms_gemm:.3f} ms"))
    for recipe in ("tensorwise", "rowwise"):
        torch._dynamo.reset()
        layer = fp8.Float8Linear.from_float(nn.Linear(1024, 1024, device=DEVICE), recipe)
        with torch.autocast("cuda", dtype=BF16):
            explained = torch._dynamo.explain(lambda t: layer(t))(rand(256, 1024))
        out.append(dict(name=f"Float8Linear {recipe} under torch.compile", ok=explained.graph_break_count == 0,
                        check=f"{explained.graph_count} graph(s), {explained.graph_break_count} break(s)"
                              + "".join(f"; {r.reason}"[:120] for r in explained.break_reasons[:2]), speed="-"))
    return dict(rows=out)


def _linear_step(layer, x, dy):
    """Forward + backward of `layer` on x under bf16 autocast, with fresh gradients each call."""
    x = x.detach().requires_grad_()

    def step():
        x.grad = None
        layer.weight.grad = layer.bias.grad = None
        with torch.autocast("cuda", dtype=BF16):
            y = layer(x)
        y.backward(dy)
    return step
