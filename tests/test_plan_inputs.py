"""plan.py's bad inputs: every flag and --layout key a new user can get wrong gives one `error:` line on stderr and
exit 2, before any work (never a traceback, never a silent guess); good spellings still read."""
import subprocess
import sys

import pytest

import plan
from planner.cli import build_job, parse_args, parse_layout

BASE = ["--model", "gpt2", "--gpus", "8", "--seq", "1024", "--global_batch_tokens", "64K"]


def layout(text):
    return BASE + ["--layout", text]


BAD = [
    # --layout keys: zero / negative / unknown / loose / inconsistent
    (layout("micro_batch_size=0"), "micro_batch_size=0 must be a positive integer"),
    (layout("v=0,pp=2,schedule=interleaved"), "v=0 must be a positive integer"),
    (layout("tp=0"), "tp=0 must be a positive integer"),
    (layout("dp=0"), "dp=0 must be a positive integer"),
    (layout("pp=-2"), "pp='-2' is not a whole number"),
    (layout("micro_batch_size=1.5"), "is not a whole number"),
    (layout("zero_stage=5"), "zero_stage=5; ZeRO has stages 0, 1, 2 and 3"),
    (layout("tp=2,sp=yes"), "sp='yes' is not a boolean"),
    (layout("tp=2") + ["--loss", "linear_ce"], "needs the whole vocabulary on one rank"),
    (BASE + ["--loss_chunks", "0"], "--loss_chunks must be a positive integer"),
    (BASE + ["--loss", "apex"], "invalid choice: 'apex'"),
    (layout("tp=2,sp=on"), "sp='on' is not a boolean"),
    (layout("schedule=interleaved"), "needs pp > 1"),
    (layout("schedule=zbv"), "needs pp > 1"),
    (layout("v=2"), "needs pp > 1"),
    (layout("pp=2,schedule=wavy"), "unknown schedule 'wavy'"),
    (layout("recompute=some"), "unknown recompute 'some'"),
    (layout("tensor=2"), "unknown key 'tensor'"),
    (layout("tp"), "is not key=value"),
    (layout("tp=2,,pp=2"), "is not key=value"),
    (layout("tp=2,tp=4"), "tp is given twice"),
    (layout("schedule="), "schedule has no value"),
    (layout("tp=3"), "does not divide"),
    (layout("tp=8"), "n_head=12 is not divisible by tp=8"),
    (BASE + ["--n_layer", "4", "--layout", "pp=8"], "n_layer=4 not divisible by pp*v=8"),
    (BASE + ["--first_stage_layers", "6", "--last_stage_layers", "6", "--layout", "pp=4"], "does not fill 4"),
    (BASE + ["--first_stage_layers", "-1"], "--first_stage_layers must be >= 0"),
    (BASE + ["--n_kv_head", "5"], "--n_kv_head 5 must divide n_head=12"),
    (BASE + ["--n_kv_head", "0"], "--n_kv_head must be a positive integer"),
    (BASE + ["--ffn_hidden", "-1"], "--ffn_hidden must be a positive integer"),
    (BASE + ["--n_kv_head", "2", "--layout", "tp=4"], "n_kv_head=2 is not divisible by tp=4"),
    (BASE + ["--tp_overlap", "1.5"], "--tp_overlap is a share in [0, 1]"),
    (BASE + ["--dropout", "1"], "--dropout is a probability in [0, 1)"),
    (BASE + ["--moments", "fp8"], "invalid choice: 'fp8'"),
    (BASE + ["--software", "deepspeed"], "invalid choice: 'deepspeed'"),
    (BASE + ["--gated", "yes"], "unrecognized arguments: yes"),
    (layout("dp=3"), "!= 8 GPUs"),
    (BASE + ["--n_layer", "100000"], "--n_layer 100000: plan.py plans up to 1024 layers"),
    # flags: ranges, NaN, unknown, unreadable
    (BASE + ["--eff", "2"], "--eff is a fraction of peak in (0, 1], got 2.0"),
    (BASE + ["--eff", "-1"], "--eff is a fraction of peak in (0, 1], got -1.0"),
    (BASE + ["--eff", "0"], "--eff is a fraction of peak in (0, 1]"),
    (BASE + ["--eff", "nan"], "invalid float value: 'nan'"),
    (BASE + ["--gpus_per_node", "3"], "--gpus 8 is not a whole number of nodes of --gpus_per_node 3"),
    (["--model", "gpt2", "--gpus", "12", "--gpus_per_node", "8"], "not a whole number of nodes"),
    (BASE + ["--gpus", "0"], "--gpus must be a positive integer"),
    (BASE + ["--gpus", "-8"], "--gpus must be a positive integer"),
    (BASE + ["--gpus_per_node", "0"], "--gpus_per_node must be a positive integer"),
    (BASE + ["--seq", "0"], "--seq must be a positive integer"),
    (BASE + ["--top", "0"], "--top must be a positive integer"),
    (BASE + ["--n_layer", "0"], "--n_layer must be a positive integer, got 0"),
    (BASE + ["--n_embd", "-768"], "--n_embd must be a positive integer"),
    (BASE + ["--n_head", "0"], "--n_head must be a positive integer"),
    (BASE + ["--vocab", "0"], "--vocab must be a positive integer"),
    (BASE + ["--n_head", "7"], "n_embd must be divisible by n_head"),
    (BASE + ["--n_experts", "-1"], "--n_experts must be >= 0"),
    (BASE + ["--n_experts", "4", "--top_k", "5"], "--top_k 5 exceeds --n_experts 4"),
    (BASE + ["--top_k", "0"], "--top_k must be a positive integer"),
    (BASE + ["--capacity_factor", "-1"], "--capacity_factor must be >= 0"),
    (BASE + ["--capacity_factor", "inf"], "invalid float value: 'inf'"),
    (BASE + ["--bucket_mb", "0"], "--bucket_mb must be positive"),
    (BASE + ["--bucket_mb", "nan"], "invalid float value"),
    (BASE + ["--bucket_mb_per_dp", "-1"], "--bucket_mb_per_dp must be 0 or more"),
    (BASE + ["--net_gbps", "0"], "--net_gbps must be positive"),
    (BASE + ["--net_gbps", "-50"], "--net_gbps must be positive"),
    (BASE + ["--gpus", "eight"], "invalid int value: 'eight'"),
    (BASE + ["--global_batch_tokens", "lots"], "cannot read"),
    (BASE + ["--global_batch_tokens=-4M"], "cannot read"),
    (BASE + ["--global_batch_tokens", "0"], "not a multiple of seq"),
    (BASE + ["--global_batch_tokens", "1000"], "not a multiple of seq"),
    (BASE + ["--precision", "fp8"], "invalid choice: 'fp8'"),
    (BASE + ["--attn", "sparse"], "invalid choice: 'sparse'"),
    (BASE + ["--gpu", "x100"], "unknown GPU 'x100'"),
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--n_layer", "2"], "give --model or all of"),
    (BASE + ["--tensor_parallel", "2"], "unrecognized arguments: --tensor_parallel 2"),
    # a billion GPUs: said at once, not after a search over every number up to the GPU count
    (BASE + ["--gpus", "1000000000"], "--gpus 1000000000: plan.py plans up to 1048576 GPUs"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a[len(BASE):] or a) for a, _ in BAD])
def test_bad_input_one_error_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        plan.main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), captured.err
    assert message in err[0], err[0]
    assert captured.out == ""                       # before any work: no table, no partial output


@pytest.mark.parametrize("argv", [layout("zero_stage=5"), BASE + ["--eff", "2"], BASE + ["--gpus", "eight"]])
def test_bad_input_from_the_command_line(argv):
    """The same through the real CLI: one line on stderr, exit 2, no traceback."""
    r = subprocess.run([sys.executable, "plan.py"] + argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr


@pytest.mark.parametrize("text,sp", [("sp=true", True), ("sp=True", True), ("sp=1", True), ("sp=false", False),
                                     ("sp=FALSE", False), ("sp=0", False)])
def test_booleans_read_strictly_and_case_blind(text, sp):
    job = build_job(parse_args(BASE, ""))
    assert parse_layout(f"tp=2,{text}", job).sp is sp


def test_good_layout_reads():
    job = build_job(parse_args(BASE, ""))
    lay = parse_layout(" pp=2, schedule=interleaved ,zero_stage=0,micro_batch_size=2", job)
    assert (lay.dp, lay.pp, lay.v, lay.schedule, lay.micro_batch_size) == (4, 2, 2, "interleaved", 2)
    assert parse_layout("pp=2,schedule=interleaved,v=3", job).v == 3
    assert build_job(parse_args(BASE + ["--gpus", "4"], "")).gpus == 4          # part of one node
    assert build_job(parse_args(BASE + ["--eff", "1"], "")).eff == 1.0


def test_partial_layout_searches_the_keys_it_leaves_out(capsys):
    """--layout pp=2,zero_stage=1 keeps those two and takes the fastest fitting layout among those the search finds
    with them, printing the keys it chose; a layout naming every key is evaluated as given."""
    job = build_job(parse_args(BASE, ""))
    row = plan.main(layout("pp=2,zero_stage=1"))[0]
    out = capsys.readouterr().out
    assert (row["pp"], row["zero_stage"], row["oom"]) == (2, 1, False)
    assert row["searched"] == ["dp", "tp", "cp", "ep", "sp", "schedule", "v", "micro_batch_size", "recompute"]
    assert out.startswith("--layout pp=2,zero_stage=1: the keys it leaves out searched") and "schedule=" in out
    same = [r for r in plan.rank_layouts(job) if r["pp"] == 2 and r["zero_stage"] == 1 and not r["oom"]]
    assert row["tokens_per_s"] == max(r["tokens_per_s"] for r in same)
    full = "dp=4,tp=1,cp=1,pp=2,ep=1,sp=false,zero_stage=1,schedule=1f1b,v=1,micro_batch_size=2,recompute=none"
    given = plan.main(layout(full))[0]
    assert given["searched"] == []
    assert given["tokens_per_s"] == plan.evaluate(job, parse_layout(full, job))["tokens_per_s"]
    assert not capsys.readouterr().out.startswith("--layout")


def test_partial_interleaved_layout_searches_deep_interleaving():
    """An interleaved layout without v tries every v up to one layer per chunk (the search's own stops at 4). On H200s:
    on 80 GB H100s Llama 3's own layout is a close call on its middle stages (m = p = 16 micro-batches, all of them in
    flight under the interleaved schedule, a stage of 8 layers between the cut ends), over the usable memory."""
    argv = ["--model", "llama3-405b", "--gpus", "16384", "--gpu", "h200", "--seq", "8192", "--global_batch_tokens", "16M",
            "--ends_as_layers", "--layout", "tp=8,cp=1,pp=16,sp=true,zero_stage=1,schedule=interleaved,"
            "micro_batch_size=1,recompute=none"]
    row = plan.main(argv + ["--json"])[0]
    assert row["searched"] == ["ep", "v"] and row["v"] == 8 and not row["oom"]
    job = build_job(parse_args(argv, ""))
    for v in (2, 4):
        lay = plan.Layout(dp=128, tp=8, pp=16, sp=True, zero_stage=1, schedule="interleaved", v=v)
        other = plan.evaluate(job, lay)
        assert other["oom"] or other["tokens_per_s"] <= row["tokens_per_s"]


def test_software_sets_its_stack_unless_a_flag_says_otherwise(monkeypatch):
    """--software fills the Job fields of timing.SOFTWARE's entry; a flag given beside it with another value wins."""
    from dataclasses import fields
    from planner.timing import SOFTWARE
    assert all(set(entry) <= {f.name for f in fields(plan.Job)} for entry in SOFTWARE.values())
    job = build_job(parse_args(BASE + ["--software", "megatron-2021"], ""))
    assert (job.attn, job.dp_overlap, job.pp_scatter_gather, job.tp_overlap) == ("eager", False, True, 0.0)
    job = build_job(parse_args(BASE + ["--software", "megatron-core", "--tp_overlap", "0.5"], ""))
    assert (job.tp_overlap, job.pp_overlap, job.dp_overlap) == (0.5, True, True)
    # a flag given at its own default value still wins over the stack's (megatron-2021: no dp overlap, eager
    # attention, pipeline messages scattered)
    for given, want in ((["--dp_overlap"], (True, "eager", True)), (["--attn", "flash"], (False, "flash", True)),
                        (["--no-pp_scatter_gather"], (False, "eager", False))):
        job = build_job(parse_args(BASE + ["--software", "megatron-2021", *given], ""))
        assert (job.dp_overlap, job.attn, job.pp_scatter_gather) == want, given
    monkeypatch.setattr(sys, "argv", ["plan.py", *BASE, "--software", "megatron-2021", "--dp_overlap"])
    assert build_job(parse_args(None, "")).dp_overlap          # from the command line alike
    plain = build_job(parse_args(BASE, ""))
    assert (plain.attn, plain.tp_overlap, plain.pp_overlap) == ("flash", 0.0, False)


def test_megatron_core_bucket_grows_with_the_reduction_group():
    """Megatron-Core's default bucket, max(4e7, 1e6 x dp) parameters: at dp 256 a bucket holds 256M parameters, so
    llama3-8b's 8.03B make about 32 dp collectives (a parameter larger than a bucket is one of its own), where fixed
    25 MiB buckets make one per weight matrix (each above 25 MiB) and one per RMSNorm weight between two of them: 6 per
    block, and the embedding, ln_f and the head; their NCCL latency scales with the count. At dp 8 the 4e7 floor holds.
    plan.py's own default grows the same way above 25 MiB, and its launch line passes that bucket to train_5d."""
    argv = ["--model", "llama3-8b", "--seq", "4096", "--global_batch_tokens", "8M", "--gpu", "h100"]

    def groups_and_dp_latency(gpus, *extra):
        job = build_job(parse_args(argv + ["--gpus", str(gpus), *extra], ""))
        lay = parse_layout(f"dp={gpus},zero_stage=1,micro_batch_size=1,recompute=full", job)
        mem = plan.memory(job, lay)
        return mem["groups"], plan.comm_latency(job, lay, mem["groups"])["dp"]
    plain = groups_and_dp_latency(256, "--bucket_mb_per_dp", "0")
    mcore = groups_and_dp_latency(256, "--software", "megatron-core")
    assert groups_and_dp_latency(256) == mcore                   # the default's growth: the same 256M at dp 256
    assert 8.03e9 / 256e6 <= mcore[0] <= 8.03e9 / 256e6 + 3 and plain[0] == 6 * 32 + 3
    assert plain[1] / mcore[1] == pytest.approx(plain[0] / mcore[0])
    # 40M-parameter buckets: both MLP matrices alone, the attention's two with a norm each, then the head, ln_f and
    # the embedding: 4 per block + 3
    assert groups_and_dp_latency(8, "--software", "megatron-core")[0] == 4 * 32 + 3 > mcore[0] + 90


def test_launch_line_carries_the_bucket_it_priced(capsys):
    """Where the bucket grew past train_5d's 25 MiB default, the launch line says so; at dp 4 it did not."""
    argv = ["--model", "gpt2", "--seq", "1024", "--global_batch_tokens", "256K", "--gpus_per_node", "8"]
    plan.main(argv + ["--gpus", "64", "--layout", "dp=64,zero_stage=1,micro_batch_size=1"])
    assert "--bucket_mb 244.141" in capsys.readouterr().out               # 64 x 1e6 fp32 parameters in MiB
    plan.main(argv + ["--gpus", "4", "--layout", "dp=4,zero_stage=1,micro_batch_size=1"])
    assert "--bucket_mb" not in capsys.readouterr().out


def test_search_chooses_as_before_and_no_fit_exits_without_launch(capsys):
    """The search's caches and the replay's cap change no choice: these layouts are the ones the uncached search
    chose. A job no layout fits prints its table, then one error line and no launch line, and exits 2."""
    cases = {"--model gpt2 --gpus 16 --seq 1024 --global_batch_tokens 256K --gpu a100-40gb --layout pp=4":
             "dp=4,tp=1,cp=1,pp=4,ep=1,sp=False,zero_stage=1,schedule=zb1,v=1,micro_batch_size=4,recompute=none",
             "--n_layer 8 --n_embd 512 --n_head 8 --vocab 32000 --n_experts 8 --gpus 8 --seq 2048 "
             "--global_batch_tokens 256K --layout pp=2,tp=2":
             "dp=2,tp=2,cp=1,pp=2,ep=1,sp=True,zero_stage=3,schedule=zbv,v=2,micro_batch_size=16,recompute=none"}
    for argv, chosen in cases.items():
        row = plan.main(argv.split() + ["--json"])[0]
        assert ",".join(f"{k}={row[k]}" for k in plan.Layout.__dataclass_fields__) == chosen
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        plan.main("--model llama3-70b --gpus 8 --seq 4096 --global_batch_tokens 256K --top 2".split())
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and "OOM: no layout fits" in out and "torchrun" not in out
    assert err.startswith("error: no layout fits: the smallest needs") and err.count("\n") == 1


def test_launch_line_and_layout_auto_build_the_planned_family():
    """A Llama-family job's launch line names its family (--arch llama, --n_kv_head, --ffn_hidden, --no-tied where
    untied), and train_5d's --layout auto plans the model its flags build: SmolLM2-135M's flags count 134,515,008
    parameters in plan.py's Job as in model.py."""
    from common.config import Config
    from common.model_setup import gpt_config
    from model import num_params
    from planner.report import launch_command
    from planner.shape import num_params as plan_params
    smol = build_job(parse_args("--arch llama --n_layer 30 --n_head 9 --n_embd 576 --n_kv_head 3 --ffn_hidden 1536 "
                                "--vocab 49152 --tied --gpus 2 --seq 2048 --global_batch_tokens 64K".split(), ""))
    row = plan.evaluate(smol, plan.Layout(dp=2, zero_stage=3, micro_batch_size=4))
    line = launch_command(smol, row)
    assert "--arch llama --n_kv_head 3 --ffn_hidden 1536" in line and "--no-tied" not in line
    assert launch_command(build_job(parse_args(["--model", "llama3-8b"], "")), row).endswith("--no-tied")
    cfg = Config(arch="llama", n_layer=30, n_head=9, n_embd=576, n_kv_head=3, ffn_hidden=1536, tied=True,
                 block_size=2048, global_batch_size=32)
    job = plan.plan_job(cfg, 49152, 2, 2, "h100", "amp")
    assert plan_params(job) == num_params(gpt_config(cfg, 49152)) == plan_params(smol) == 134_515_008
