"""
bench/gemm_rows.py: the matmul measurements plan.py's GEMM efficiency by shape is fitted to, the fit, and the same
sweep measured on this machine's GPU.

    python bench/gemm_rows.py            # the published table and the fit plan_time uses (seconds, no GPU)
    python bench/gemm_rows.py --measure  # on a GPU: the same shapes timed with torch.matmul, and their own fit
    python bench/gemm_rows.py --measure --save   # ... and causal attention's rate, saved as this card's rate table
                                                 # (bench/results/rates/<card>.json: planner/rates.py reads it)

The measurements: OpenXLA's default matmul performance table for H100 (sm_90), tensorflow/tensorflow
third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h (kDefaultMatmulPTable, bf16 x bf16 -> bf16 FLOP/s
of b x (m x k) x (k x n) GEMMs); the b = 1 entries with k = 4096 (m, n from 256 to 4096: the output's size) and
with m = n = 4096 (k from 256 to 4096: the reduction's depth). Two curves, each one constant, fitted by least squares
on log FLOP/s against the measured ceiling (planner/timing.GEMM_EFF's 792.1 TFLOP/s), two constants each:
    FLOP/s = ceiling / ((1 + (E0 / (m n))^a) (1 + (K0 / k)^b))
Nothing else goes into them: no training run.
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CEILING = 792.1e12       # H100 SXM, bf16: planner/timing.GEMM_EFF["h100"] x 989 TFLOP/s (S. Bekman's MAMF table)
# (m, n, k, TFLOP/s) from the table above, b = 1
OUTPUT = [(256, 4096, 4096, 412.0), (512, 2048, 4096, 430.5), (1024, 1024, 4096, 470.1), (2048, 512, 4096, 451.2),
          (4096, 256, 4096, 376.2), (512, 4096, 4096, 644.1), (1024, 2048, 4096, 653.5), (2048, 1024, 4096, 653.1),
          (4096, 512, 4096, 650.0), (1024, 4096, 4096, 738.5), (2048, 2048, 4096, 738.0), (4096, 1024, 4096, 738.5),
          (2048, 4096, 4096, 753.6), (4096, 2048, 4096, 758.4), (4096, 4096, 4096, 783.3)]
DEPTH = [(4096, 4096, 256, 392.2), (4096, 4096, 512, 543.1), (4096, 4096, 1024, 677.4), (4096, 4096, 2048, 738.7),
         (4096, 4096, 4096, 783.3)]


def fit(points, size, ceiling=CEILING):
    """The constants (c, a) (c on a log grid, a in steps of 0.1) that best fit FLOP/s = ceiling / (1 + (c /
    size(point))^a), and the rms log error."""
    best = None
    for i in range(600):
        c = 10 ** (1 + 6 * i / 600)
        for a in (x / 10 for x in range(5, 31)):
            err = math.sqrt(sum(math.log(ceiling / (1 + (c / size(p)) ** a) / (p[3] * 1e12)) ** 2 for p in points)
                            / len(points))
            if best is None or err < best[2]:
                best = (c, a, err)
    return best


def fitted():
    """((E0, a, rms error), (K0, b, rms error)) from the published table."""
    return fit(OUTPUT, lambda p: p[0] * p[1]), fit(DEPTH, lambda p: p[2])


def measure(points, repeat=20):
    """The same shapes timed with torch.matmul in bf16 on this GPU: [(m, n, k, TFLOP/s)]."""
    import torch
    out = []
    for m, n, k, _ in points:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            a @ b
        end.record()
        torch.cuda.synchronize()
        out.append((m, n, k, 2 * m * n * k * repeat / (start.elapsed_time(end) / 1e3) / 1e12))
    return out


# causal attention rows timed for the table: (batch, heads, seq, head_dim), bf16, torch's SDPA (its flash kernel)
ATTENTION = [(4, 32, 2048, 128), (2, 32, 4096, 128), (1, 32, 8192, 128)]


def measure_attention(rows=ATTENTION, repeat=10):
    """Causal SDPA forward + backward on this GPU: [(batch, heads, seq, head_dim, TFLOP/s)] on plan's count of
    executed FLOPs (timing.ATTN_EFF's convention: 4 b a s^2 d forward, twice that backward, halved for causal)."""
    import torch
    import torch.nn.functional as F
    out = []
    for b, a, s, d in rows:
        q, k, v = (torch.randn(b, a, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for i in range(repeat + 3):
            if i == 3:
                start.record()
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        end.record()
        torch.cuda.synchronize()
        flops = 3 * 4 * b * a * s * s * d / 2 * repeat
        out.append((b, a, s, d, flops / (start.elapsed_time(end) / 1e3) / 1e12))
    return out


def rate_table(gemm, attention, device, peak_tflops, torch_version):
    """The card's rate table (planner/rates.py's format) from measured GEMM rows [(m, n, k, TFLOP/s)] (OUTPUT's
    shapes, then DEPTH's) and attention rows, the GEMM shape fitted against their own fastest row."""
    from plan import gpu_kind
    if gpu_kind(device) is None:
        sys.exit(f"error: plan.py has no card for {device!r} (planner/inputs.HARDWARE): nothing to key the table by")
    ceiling = max(row[-1] for row in gemm) * 1e12
    output, depth = gemm[:len(OUTPUT)], gemm[len(OUTPUT):]
    (e0, a, _), (k0, b, _) = fit(output, lambda q: q[0] * q[1], ceiling), fit(depth, lambda q: q[2], ceiling)
    return dict(card=gpu_kind(device), device=device, torch=torch_version, peak_tflops=peak_tflops,
                gemm=[list(row) for row in gemm], gemm_shape=dict(e0=e0, a=a, k0=k0, b=b),
                attention=[list(row) for row in attention])


def save_table(table, directory=None):
    """Write a rate table where planner/rates.py reads it; returns the path."""
    import json
    from planner.rates import table_path
    path = table_path(table["card"], directory)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measure", action="store_true", help="time the shapes on this machine's GPU and fit those")
    p.add_argument("--save", action="store_true", help="with --measure: time causal attention too and save this card's "
                   "rate table (bench/results/rates/<card>.json), which plan.py then prices this card with")
    p.add_argument("--rates_dir", default=None, help="with --save: the folder to write it to (default "
                   "bench/results/rates, where plan.py reads it)")
    args = p.parse_args(argv)
    if args.save and not args.measure:
        sys.exit("error: --save writes a measured table: give --measure, on a GPU")
    points = (OUTPUT, DEPTH)
    if args.measure:
        points = (measure(OUTPUT), measure(DEPTH))
    print("| m | n | k | TFLOP/s | fitted |\n|---|---|---|---|---|")
    (e0, a, e_err), (k0, b, k_err) = fit(points[0], lambda q: q[0] * q[1]), fit(points[1], lambda q: q[2])
    for m, n, k, tflops in points[0] + points[1]:
        model = CEILING / (1 + (e0 / (m * n)) ** a) / (1 + (k0 / k) ** b) / 1e12
        print(f"| {m} | {n} | {k} | {tflops:.1f} | {model:.1f} |")
    if args.save:
        import torch
        from common.peaks import gpu_peak_flops
        device = torch.cuda.get_device_name()
        table = rate_table(points[0] + points[1], measure_attention(), device, gpu_peak_flops(device) / 1e12,
                           torch.__version__)
        print(f"saved {save_table(table, args.rates_dir)}")
    print(f"\nE0 = {e0:.3g} output elements, a = {a:.1f} (rms error {100 * e_err:.1f}%); K0 = {k0:.3g}, b = {b:.1f} "
          f"(rms {100 * k_err:.1f}%)")
    return (e0, a), (k0, b)


if __name__ == "__main__":
    main()
