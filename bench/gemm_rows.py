"""
bench/gemm_rows.py: the matmul measurements plan.py's GEMM efficiency by shape is fitted to, the fit, and the same
sweep measured on this machine's GPU.

    python bench/gemm_rows.py            # the published table and the fit plan_time uses (seconds, no GPU)
    python bench/gemm_rows.py --measure  # on a GPU: the same shapes timed with torch.matmul, and their own fit

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

CEILING = 792.1e12       # H100 SXM, bf16: planner/timing.GEMM_EFF["h100"] x 989 TFLOP/s (S. Bekman's MAMF table)
# (m, n, k, TFLOP/s) from the table above, b = 1
OUTPUT = [(256, 4096, 4096, 412.0), (512, 2048, 4096, 430.5), (1024, 1024, 4096, 470.1), (2048, 512, 4096, 451.2),
          (4096, 256, 4096, 376.2), (512, 4096, 4096, 644.1), (1024, 2048, 4096, 653.5), (2048, 1024, 4096, 653.1),
          (4096, 512, 4096, 650.0), (1024, 4096, 4096, 738.5), (2048, 2048, 4096, 738.0), (4096, 1024, 4096, 738.5),
          (2048, 4096, 4096, 753.6), (4096, 2048, 4096, 758.4), (4096, 4096, 4096, 783.3)]
DEPTH = [(4096, 4096, 256, 392.2), (4096, 4096, 512, 543.1), (4096, 4096, 1024, 677.4), (4096, 4096, 2048, 738.7),
         (4096, 4096, 4096, 783.3)]


def fit(points, size):
    """The constants (c, a) (c on a log grid, a in steps of 0.1) that best fit FLOP/s = CEILING / (1 + (c /
    size(point))^a), and the rms log error."""
    best = None
    for i in range(600):
        c = 10 ** (1 + 6 * i / 600)
        for a in (x / 10 for x in range(5, 31)):
            err = math.sqrt(sum(math.log(CEILING / (1 + (c / size(p)) ** a) / (p[3] * 1e12)) ** 2 for p in points)
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measure", action="store_true", help="time the shapes on this machine's GPU and fit those")
    args = p.parse_args(argv)
    points = (OUTPUT, DEPTH)
    if args.measure:
        points = (measure(OUTPUT), measure(DEPTH))
    print("| m | n | k | TFLOP/s | fitted |\n|---|---|---|---|---|")
    (e0, a, e_err), (k0, b, k_err) = fit(points[0], lambda q: q[0] * q[1]), fit(points[1], lambda q: q[2])
    for m, n, k, tflops in points[0] + points[1]:
        model = CEILING / (1 + (e0 / (m * n)) ** a) / (1 + (k0 / k) ** b) / 1e12
        print(f"| {m} | {n} | {k} | {tflops:.1f} | {model:.1f} |")
    print(f"\nE0 = {e0:.3g} output elements, a = {a:.1f} (rms error {100 * e_err:.1f}%); K0 = {k0:.3g}, b = {b:.1f} "
          f"(rms {100 * k_err:.1f}%)")
    return (e0, a), (k0, b)


if __name__ == "__main__":
    main()
