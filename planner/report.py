"""
planner/report.py: plan.py's printed table (a row per layout: memory by part in GiB, time by part in ms, tokens/s, MFU,
the verdict), the summary under it (how many fit, close calls, where the first row's memory peaks, which rates
priced the compute) and the train_5d.py command of a row.
"""
from common.config import Config
from common.model_setup import ARCHS
from pipeline.schedules import V_SHAPED
from planner import shape as plan_shape
from planner.device_memory import CLOSE_CALL
from planner.inputs import GIB
from planner.memory import MEM_PARTS, bucket_mb


def family_of(job):
    """The --arch (common.model_setup.ARCHS) whose norm, MLP and biases the job's model has, or None (a GPT with a
    gated MLP, say: no train_5d flag builds it)."""
    cfg = job.cfg
    have = dict(norm=cfg.norm, mlp="swiglu" if job.gated else "gelu", qkv_bias=cfg.qkv_bias, bias=cfg.bias)
    gpt2 = dict(norm="layernorm", mlp="gelu", qkv_bias=True, bias=True)       # model.GPTConfig's defaults
    for name, fields in ARCHS.items():             # (mixtral is llama's fields with renormalized gates: llama's)
        if name != "mixtral" and have == {**gpt2, **{k: v for k, v in fields.items() if k in gpt2}}:
            return name
    return None


def launch_command(job, row):
    """The train_5d.py command line of a layout (flag names as in config.py)."""
    cfg = job.cfg
    flags = {k: row[k] for k in ("dp", "tp", "cp", "pp", "ep", "zero_stage", "micro_batch_size", "recompute")}
    flags.update(pp_schedule=row["schedule"], pp_virtual=row["v"], n_layer=cfg.n_layer, n_head=cfg.n_head,
                 n_embd=cfg.n_embd, block_size=cfg.block_size, global_batch_size=job.global_seqs,
                 dtype="float32" if job.precision == "fp32" else "bfloat16")
    family = family_of(job)
    if family not in (None, "gpt"):
        flags.update(arch=family)
    if job.n_kv_head and job.n_kv_head != cfg.n_head:
        flags.update(n_kv_head=job.n_kv_head)
    if job.ffn_hidden:
        flags.update(ffn_hidden=job.ffn_hidden)
    if cfg.n_experts:
        flags.update(n_experts=cfg.n_experts, top_k=cfg.top_k)
    if cfg.capacity_factor:
        flags.update(capacity_factor=cfg.capacity_factor)
    bucket = bucket_mb(job, row["dp"] * row["cp"])
    if bucket != Config.bucket_mb:                              # the bucket plan.py priced, where not the default
        flags.update(bucket_mb=f"{bucket:g}")
    uneven = cfg.n_layer % (row["pp"] * row["v"]) != 0       # train_5d's --pp_uneven: plan.py's even_split
    args = " ".join(f"--{k} {v}" for k, v in flags.items()) + (" --sp" if row["sp"] else "") + \
        (" --pp_uneven" if uneven else "") + ("" if job.tied else " --no-tied")
    return (f"torchrun --nnodes {max(1, job.gpus // job.gpus_per_node)} --nproc_per_node "
            f"{min(job.gpus, job.gpus_per_node)} train_5d.py {args}")


HEADER = ("  #   dp tp cp  pp ep sp zero    schedule v mbs recompute | "
          "params  grads  optim   acts other  alloc  resvd GiB | "
          "compute attnHBM  bubble      tp      cp      dp      pp      ep    tied (ms) |   tokens/s   MFU")


def format_row(i, r):
    """Row i of the table: the layout, memory parts in GiB, time parts in ms, tokens/s, MFU, fits or OOM."""
    mem, t = r["mem_bytes"], r["time_s"]
    return (f"{i:3d} {r['dp']:4d} {r['tp']:2d} {r['cp']:2d} {r['pp']:3d} {r['ep']:2d} {'y' if r['sp'] else '-':>2s} "
            f"{r['zero_stage']:4d} {r['schedule'] if r['pp'] > 1 else '-':>11s} {r['v']} {r['micro_batch_size']:3d} "
            f"{r['recompute']:>9s} | " + " ".join(f"{mem[k] / GIB:6.1f}" for k in MEM_PARTS) + " | "
            + " ".join(f"{1e3 * t[k]:7.1f}" for k in ("compute", "attn_hbm", "bubble", "tp", "cp", "dp", "pp", "ep", "tied"))
            + f" | {r['tokens_per_s']:10.0f} {100 * r['mfu']:5.1f}% {verdict_text(r)}")


def peak_place(r):
    """Where a row's memory peaks: its one GPU, or the pipeline rank and what that rank holds."""
    if r["pp"] == 1:
        return "its one pipeline stage"
    last = r["peak_rank"] == (0 if r["schedule"] in V_SHAPED else r["pp"] - 1)
    holds = "both ends (in a V)" if last and r["peak_rank"] == 0 else "the LM head and loss" if last else \
        "the first stage's micro-batches in flight" if r["peak_rank"] == 0 else \
        "a middle stage's layers x micro-batches in flight"
    return f"pipeline rank {r['peak_rank']} of {r['pp']}, {holds}"


def verdict_text(r):
    """'fits', 'OOM', or a close call with its side: 'close (fits)', 'close (OOM)'."""
    side = "OOM" if r["oom"] else "fits"
    return f"close ({side})" if r["verdict"] == "close" else side


def print_table(job, rows, top):
    """The job in one line, the first `top` rows, how many fit and the launch command of the best."""
    cfg = job.cfg
    print(f"{plan_shape.num_params(job) / 1e9:.2f}B params (L={cfg.n_layer}, h={cfg.n_embd}, a={cfg.n_head}, "
          f"kv={job.n_kv_head or cfg.n_head}, f={plan_shape.ffn(job)}{' gated' if job.gated else ''}, V="
          f"{cfg.padded_vocab_size}{'' if job.tied else ' untied'}), {plan_shape.flops_per_token(job) / 1e9:.1f} "
          f"GFLOP/token; {job.gpus} x {job.gpu}, "
          f"{job.gpus_per_node}/node; seq {cfg.block_size}, {job.global_seqs} sequences/step, {job.precision}")
    print(f"compute priced by {rows[0]['priced_by']}")
    print(HEADER)
    print("\n".join(format_row(i + 1, r) for i, r in enumerate(rows[:top])))
    runs_as_planned = (family_of(job) is not None and rows[0]["recompute"] != "op" and job.rope
                       and not job.fused_loss and not (job.first_stage_layers or job.last_stage_layers
                                                       or job.ends_as_layers))
    close = sum(r["verdict"] == "close" for r in rows)
    counts = (f"{sum(not r['oom'] for r in rows)} of {len(rows)} layouts fit"
              + (f" ({close} a close call: within {100 * CLOSE_CALL:.0f}% of the usable memory)" if close else "")
              + f"; the first's memory peaks on {peak_place(rows[0])}")
    if rows[0]["oom"]:              # no launch line for a layout that does not fit (plan.main exits non-zero)
        print(f"OOM: no layout fits (the smallest is first). {counts}.")
        return
    print(counts + ". Launch"
          + ("" if runs_as_planned else " (the nearest model.py builds: train_5d has no gated MLP outside --arch "
                                        "llama, stage sizes of its own, learned positions, a fused loss, nor "
                                        "recompute op)")
          + f":\n{launch_command(job, rows[0])}")
