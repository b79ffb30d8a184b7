"""
Context parallelism (train_cp.py) on CPU/gloo:
- the distributed attention (ring, zigzag, allgather; cp = 2, 3, 4; lengths that are not powers of two)
  equals single-process causal attention: output, log-sum-exp and dQ/dK/dV (float64 to 1e-10, float32 to 1e-5),
  with each block kernel: plain torch, torch's fused CPU attention, the Triton flash kernel (interpreter);
- per-rank attention work: zig-zag exactly balanced, every layout's total equal to the causal count;
- bytes sent equal the formulas of train_cp.py's docstring, exactly (attention alone and the whole step);
- train_cp.py at cp = 2 and 4 reproduces train_single.py's losses and weights in every layout;
- a sequence length the layout cannot split is one clear error.
"""
import json
import os
import types

import pytest
import torch

from distributed_helper import run_workers
from kernels.backend import HAS_TRITON
from common.metrics import SavedActivationBytes
from train_helpers import (EXACT, MODELS, assert_exact, assert_same_losses, assert_same_weights, curves, losses,
                           run_single, text_argv, tiny_argv)

LAYOUTS = ("ring", "zigzag", "allgather")
B, H, D = 2, 3, 4


def seq_len_for(layout, cp):
    """Odd chunk lengths, so T is never a power of two."""
    return 5 * cp if layout == "ring" else 3 * 2 * cp


def reference_attention(q, k, v):
    """Naive causal attention on the full sequence, independent of train_cp's block functions."""
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    T = q.shape[-2]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def kernel_name(kernel):
    import train_cp
    from converters.cp_kernels import SDPA_CPU
    return {train_cp.PLAIN_TORCH: "plain torch", SDPA_CPU: "sdpa cpu"}.get(kernel, "triton flash")


def cases(cp):
    """(dtype, tolerance, block kernel): the plain-torch and torch's fused CPU blocks everywhere, the Triton
    flash kernel (CPU interpreter here, slow) at cp = 2 only."""
    import train_cp
    from converters.cp_kernels import SDPA_CPU
    plain = [(torch.float64, 1e-10, train_cp.PLAIN_TORCH), (torch.float32, 1e-5, train_cp.PLAIN_TORCH),
             (torch.float64, 1e-10, SDPA_CPU)]
    if cp != 2 or not HAS_TRITON:
        return plain
    from kernels.flash_attention import flash_attention_backward, flash_attention_forward
    return plain + [(torch.float32, 1e-5, (flash_attention_forward, flash_attention_backward))]


def attention_worker(rank, world_size):
    """cp = 2, 3 and 4 on groups of the first cp ranks of a 4-rank world: the blocks take any group."""
    import torch.distributed as dist
    import train_cp
    from common.comm import COMM, new_group
    from common.distributed import init_distributed
    init_distributed(types.SimpleNamespace(device="cpu", dist_timeout=60.0))
    results = {}
    for cp in (2, 3, 4):
        group = new_group(list(range(cp)))          # every rank creates every group, members use it
        if rank >= cp:
            continue
        for layout in LAYOUTS:
            T = seq_len_for(layout, cp)
            pos = train_cp.local_positions(layout, T, cp, dist.get_rank(group))
            for dtype, tol, kernel in cases(cp):
                g = torch.Generator().manual_seed(7)
                q, k, v, dout = (torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(4))
                full = [t.clone().requires_grad_() for t in (q, k, v)]
                ref_out, ref_lse = reference_attention(*full)
                ref_out.backward(dout)
                local = [t[..., pos, :].clone().requires_grad_() for t in (q, k, v)]
                COMM.reset()
                out, lse = train_cp.context_parallel_attention(*local, group, layout, kernel)
                out.backward(dout[..., pos, :])
                for name, got, want in (("out", out, ref_out[..., pos, :]), ("lse", lse, ref_lse[..., pos]),
                                        *((f"d{n}", t.grad, f.grad[..., pos, :]) for n, t, f in zip("qkv", local, full))):
                    err = (got.double() - want.double()).abs().max().item()
                    assert err <= tol * max(1.0, want.abs().max().item()), \
                        f"cp={cp} {layout} {dtype} {kernel_name(kernel)} {name}: error {err}"
                work = B * H * train_cp.score_elements(layout, T, cp, dist.get_rank(group))   # the blocks it ran
                results[cp, layout, str(dtype), kernel_name(kernel)] = (COMM.bytes_sent, work, T)
    return results


def test_distributed_attention_matches_full_attention():
    per_rank = run_workers(attention_worker, 4, timeout=300)
    assert len(per_rank[0]) == 3 * len(LAYOUTS) * 3 + (len(LAYOUTS) if HAS_TRITON else 0)
    for (cp, layout, dtype, kernel), (_, _, T) in per_rank[0].items():
        case = f"cp={cp} {layout} {dtype} {kernel}"
        sent = [r[cp, layout, dtype, kernel][0] for r in per_rank[:cp]]
        work = [r[cp, layout, dtype, kernel][1] for r in per_rank[:cp]]
        # bytes: KV = this rank's K and V in the input dtype, dKV = the same in fp32 (or fp64)
        kv = 2 * B * H * (T // cp) * D * (8 if dtype == "torch.float64" else 4)
        expected = (cp - 1) * 2 * kv + (cp if layout != "allgather" else cp - 1) * kv
        assert sent == [expected] * cp, f"{case}: bytes sent {sent}, theory {expected}"
        # every causal (query, key) pair is computed exactly once, somewhere
        assert sum(work) == B * H * T * (T + 1) // 2, f"{case}: work {work}"
        if layout != "ring":
            assert max(work) == min(work), f"{case} must be balanced, got {work}"
        else:       # rank r computes the causal diagonal plus r full blocks of c x c
            c = T // cp
            assert work == [B * H * (c * (c + 1) // 2 + r * c * c) for r in range(cp)], f"{case}: {work}"


# ----------------------------------------------------------------------------------------------------------
# end to end: train_cp.py vs train_single.py

def train_worker(rank, world_size, data_dir, out_root, steps):
    import torch
    import train_cp
    results = {}
    for layout in LAYOUTS:
        out_dir = os.path.join(out_root, f"{layout}{world_size}")
        argv = tiny_argv(data_dir, out_dir, max_steps=steps, cp=world_size, cp_layout=layout)
        model = train_cp.main(argv)["model"]
        if rank == 0:
            results[layout] = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    # activation bytes of the same model on one device (a one-rank group) and the full sequence
    from common.comm import new_group
    solo = new_group([0])
    if rank == 0:
        train_cp.swap_attention_cores(model, lambda: train_cp.ContextParallelAttentionCore(solo, "ring"))
        idx = torch.randint(0, 64, (4, 16))
        with SavedActivationBytes(model) as saved:
            model(idx, idx.roll(1, dims=1))
        results["act_bytes_one_device"] = saved.bytes
    return results


def step_comm_theory(cp, layout, n_params, n_layer=2, micro=4, grad_acc=2, block=16, h=32):
    """Bytes rank 0 sends in one optimizer step (fp32): attention hops + gradient and loss all-reduces."""
    kv = 2 * micro * (block // cp) * h * 4
    attention = (cp - 1) * 2 * kv + (cp if layout != "allgather" else cp - 1) * kv
    return grad_acc * n_layer * attention + 2 * (cp - 1) / cp * 4 * (n_params + 1)


@pytest.mark.parametrize("cp,steps", [(2, 20), (4, 8)])
def test_train_cp_matches_single(tiny_data, tmp_path, cp, steps):
    ref_losses, ref_weights = run_single(tiny_argv(tiny_data, str(tmp_path / "single"), max_steps=steps))
    weights = run_workers(train_worker, cp, args=(tiny_data, str(tmp_path), steps), timeout=600)[0]
    n_params = sum(p.numel() for p in ref_weights.values())
    for layout in LAYOUTS:
        out_dir = str(tmp_path / f"{layout}{cp}")
        assert_same_losses(ref_losses, losses(out_dir))
        assert_same_weights(ref_weights, {n: torch.from_numpy(a) for n, a in weights[layout].items()})
        rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
        for row in rows:
            assert row["comm_bytes"] == step_comm_theory(cp, layout, n_params), (layout, row["comm_bytes"])
        # activations are per token, so a rank keeps exactly 1/cp of one device's; the one exception is
        # cross-entropy's fp32 total-weight scalar (4 bytes), the same at every length
        single = weights["act_bytes_one_device"]
        assert all(cp * (row["act_bytes"] - 4) == single - 4 for row in rows), (rows[0]["act_bytes"], single)


def _float64_worker(rank, world_size, argvs):
    import train_cp
    out = []
    for argv in argvs:
        model = train_cp.main(argv)["model"]
        out.append({n: p.detach().numpy().copy() for n, p in model.named_parameters()} if rank == 0 else None)
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_float64_parity_exact(text_reference_for, text_data, tmp_path, cp):
    """float64 on real text across a gradient spike, clipping on: every layout (grad_acc 2; at cp=2 zig-zag also on
    the family's GQA + untied model, k and v with fewer heads than q) reproduces train_single within 1e-9 per step
    (loss and grad norm) and in the final weights."""
    runs = [(layout, "L2") for layout in LAYOUTS] + ([("zigzag", "GQA")] if cp == 2 else [])
    argvs = [text_argv(text_data, str(tmp_path / f"{layout}_{model}"), cp=cp, cp_layout=layout, micro_batch_size=4,
                       **MODELS[model]) for layout, model in runs]
    for (_, model), argv, weights in zip(runs, argvs, run_workers(_float64_worker, cp, args=(argvs,), timeout=600)[0]):
        reference = text_reference_for(model)
        assert_exact(reference[0], curves(argv[argv.index("--out_dir") + 1]))
        assert_same_weights(reference[1], {n: torch.from_numpy(a) for n, a in weights.items()}, rtol=EXACT)


def test_block_size_not_divisible_is_one_clear_error(tiny_data, tmp_path, monkeypatch, capsys):
    import train_cp
    monkeypatch.setenv("WORLD_SIZE", "2")
    for layout, block, multiple in (("ring", 15, 2), ("zigzag", 18, 4), ("allgather", 6, 4)):
        with pytest.raises(SystemExit) as e:
            train_cp.main(tiny_argv(tiny_data, str(tmp_path), cp=2, cp_layout=layout, block_size=block))
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"multiple of {multiple}" in err[0], err
    with pytest.raises(SystemExit):
        train_cp.main(tiny_argv(tiny_data, str(tmp_path), cp=4))      # cp must equal the world size
    assert "must equal the number of processes" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------
# the CUDA block attention (kernels/attention_lse.py), checked without a GPU

class EmulatedCudaOps:
    """aten's four CUDA attention ops on CPU: train_cp's plain-torch math (float64 stays float64) behind CUDA's calling
    conventions, which kernels/attention_lse.py must follow: dense batches (cum_seq None, max_q/k the lengths), no
    dropout, the memory-efficient lse padded to a multiple of 32 rows (NaN here, so a wrapper that reads it shows)."""

    @staticmethod
    def _scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal):
        import train_cp
        out, lse = train_cp.attention_forward(q, k, v, is_causal)
        return out, lse, None, None, q.shape[-2], k.shape[-2], torch.empty(2), torch.empty(()), torch.empty(0)

    @staticmethod
    def _scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, p, causal,
                                                     seed, offset):
        import train_cp
        assert cum_q is None and cum_k is None and (max_q, max_k) == (q.shape[-2], k.shape[-2]) and p == 0.0
        assert lse.shape == q.shape[:-1] and lse.is_contiguous()
        return train_cp.attention_backward(dout, q, k, v, out, lse, causal)

    @staticmethod
    def _scaled_dot_product_efficient_attention(q, k, v, bias, compute_lse, dropout_p, is_causal):
        import train_cp
        assert bias is None and compute_lse and dropout_p == 0.0
        out, lse = train_cp.attention_forward(q, k, v, is_causal)
        padded = torch.full(lse.shape[:-1] + (-(-lse.shape[-1] // 32) * 32,), float("nan"), dtype=lse.dtype)
        padded[..., : lse.shape[-1]] = lse
        return out, padded, torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)

    @staticmethod
    def _scaled_dot_product_efficient_attention_backward(dout, q, k, v, bias, out, lse, seed, offset, p, mask, causal):
        import train_cp
        assert bias is None and p == 0.0 and list(mask) == [True, True, True, False]
        assert lse.shape[-1] % 32 == 0 and lse.shape[-1] >= q.shape[-2] and lse.is_contiguous()
        return train_cp.attention_backward(dout, q, k, v, out, lse[..., : q.shape[-2]], causal) + (None,)


def cuda_pairs_worker(rank, world_size):
    """Ring, zigzag and allgather at cp = 2 with each CUDA pair on the emulated ops, against full attention."""
    import train_cp
    from common.distributed import init_distributed
    from kernels import attention_lse
    init_distributed(types.SimpleNamespace(device="cpu", dist_timeout=60.0))
    attention_lse.aten = EmulatedCudaOps
    import torch.distributed as dist
    for layout in LAYOUTS:
        T = seq_len_for(layout, 2)
        pos = train_cp.local_positions(layout, T, 2, rank)
        for name, pair in (("flash", attention_lse.FLASH_CUDA), ("efficient", attention_lse.EFFICIENT_CUDA)):
            g = torch.Generator().manual_seed(7)
            q, k, v, dout = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(4))
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref_out, ref_lse = reference_attention(*full)
            ref_out.backward(dout)
            local = [t[..., pos, :].clone().requires_grad_() for t in (q, k, v)]
            out, lse = train_cp.context_parallel_attention(*local, dist.group.WORLD, layout, pair)
            out.backward(dout[..., pos, :])
            for what, got, want in (("out", out, ref_out[..., pos, :]), ("lse", lse, ref_lse[..., pos]),
                                    *((f"d{n}", t.grad, f.grad[..., pos, :]) for n, t, f in zip("qkv", local, full))):
                err = (got - want).abs().max().item()
                assert err <= 1e-10, f"{layout} {name} {what}: error {err}"


def test_cuda_block_attention_wrappers_follow_the_ops_conventions():
    run_workers(cuda_pairs_worker, 2, timeout=300)


@pytest.mark.parametrize("pair, dtype", [("FLASH_CUDA", torch.bfloat16), ("EFFICIENT_CUDA", torch.float32),
                                         ("EFFICIENT_CUDA", torch.bfloat16)])
def test_cuda_block_attention_ops_exist_with_these_shapes(pair, dtype):
    """The installed torch's CUDA ops (their meta kernels) take the wrappers' arguments and give train_cp's shapes:
    a causal diagonal block and a rectangular one."""
    from kernels import attention_lse
    forward, backward = getattr(attention_lse, pair)
    for (tq, tk), causal in (((40, 40), True), ((40, 24), False)):
        q = torch.empty(2, 4, tq, 64, device="meta", dtype=dtype)
        k, v = (torch.empty(2, 4, tk, 64, device="meta", dtype=dtype) for _ in range(2))
        out, lse = forward(q, k, v, causal)
        assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, 4, tq) and lse.dtype == torch.float32
        dq, dk, dv = backward(out, q, k, v, out, lse, causal)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_cuda_block_attention_choice():
    """Which pair train_cp runs on a GPU, by dtype, head dim and compute capability (flash: 16-bit, head dim a
    multiple of 8 up to 256, sm80+; memory-efficient: fp32 too, 16-byte rows; else the plain-torch reference)."""
    from kernels.attention_lse import EFFICIENT_CUDA, FLASH_CUDA, fused_block_attention
    cuda, h100, t4 = torch.device("cuda"), (9, 0), (7, 5)
    assert fused_block_attention(cuda, torch.bfloat16, 64, h100) is FLASH_CUDA
    assert fused_block_attention(cuda, torch.float16, 256, (8, 0)) is FLASH_CUDA
    assert fused_block_attention(cuda, torch.bfloat16, 64, t4) is EFFICIENT_CUDA
    assert fused_block_attention(cuda, torch.bfloat16, 264, h100) is EFFICIENT_CUDA
    assert fused_block_attention(cuda, torch.float32, 12, h100) is EFFICIENT_CUDA
    assert fused_block_attention(cuda, torch.bfloat16, 12, h100) is None        # 24-byte rows
    assert fused_block_attention(cuda, torch.float64, 64, h100) is None
    assert fused_block_attention(torch.device("cpu"), torch.float32, 64) is None


def test_block_attention_kernel_by_flag_device_and_dtype(monkeypatch):
    """train_cp.block_attention_kernel, which train_cp and train_5d both call: on a GPU (its capability faked: none
    here) the fused aten pair unless --kernels torch; float64 falls back to the reference; the CPU's fused pair on CPU."""
    import train_cp
    from converters.cp_kernels import SDPA_CPU
    from kernels.attention_lse import EFFICIENT_CUDA, FLASH_CUDA
    from kernels.flash_attention import flash_attention_forward
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert train_cp.block_attention_kernel("auto", cuda, torch.bfloat16, 64) is FLASH_CUDA
    assert train_cp.block_attention_kernel("compile", cuda, torch.bfloat16, 64) is FLASH_CUDA
    assert train_cp.block_attention_kernel("auto", cuda, torch.float32, 64) is EFFICIENT_CUDA
    assert train_cp.block_attention_kernel("torch", cuda, torch.bfloat16, 64) is train_cp.PLAIN_TORCH
    assert train_cp.block_attention_kernel("auto", cuda, torch.float64, 64) is train_cp.PLAIN_TORCH
    assert train_cp.block_attention_kernel("triton", cuda, torch.bfloat16, 64)[0] is flash_attention_forward
    assert train_cp.block_attention_kernel("auto", cpu, torch.float64, 64) is SDPA_CPU


def _5d_cp_kernel_choice(rank, world, argv):
    """train_5d.main with cp = 2 and train_cp's choice recorded: (its arguments, whether every CP core runs it)."""
    import train_5d
    calls, choose = [], train_5d.block_attention_kernel

    def recorded(*args):
        calls.append(args)
        return choose(*args)
    train_5d.block_attention_kernel = recorded
    result = train_5d.main(argv)
    cores = [m for m in result["chunks"].modules() if isinstance(m, train_5d.ContextParallelAttentionCore)]
    return calls, bool(cores) and all(core.kernel is choose(*calls[0]) for core in cores)


def test_5d_cp_asks_train_cp_for_its_kernel_in_the_compute_dtype(tiny_data, tmp_path):
    """train_5d's CP cores run what train_cp would pick, asked with the compute dtype (bf16: on a GPU that is the
    flash pair, test above), not the parameters' fp32."""
    argv = tiny_argv(tiny_data, str(tmp_path), cp=2, dtype="bfloat16", max_steps=1, block_size=16)
    for calls, cores_run_it in run_workers(_5d_cp_kernel_choice, 2, args=(argv,)):
        assert [(kernels, device.type, dtype) for kernels, device, dtype, _ in calls] == \
            [("auto", "cpu", torch.bfloat16)], calls
        assert cores_run_it
