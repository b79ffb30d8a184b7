"""Kinds of bad input refused in one `error:` line before any work, checked where every entry point shares the
check: numbers in odd spellings and flag prefixes (every parser), integers no run can use, a run that cannot fit
memory, launcher variables no launcher sets, data files that are pipes, devices, dangling links or of another
width, and bench.sh's arguments. In-process where the check is a function; a subprocess where the hang or the
work it prevents would happen."""
import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import plan
from common import data, errors, model_setup, startup
from common.config import ConfigError, parse_collectives_args, parse_config
from common.distributed import DistEnv, launch_env, rendezvous_problem
from test_failures import one_error_line
from train_helpers import make_tiny_dataset, run_single, tiny_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------------------
# spellings and prefixes

@pytest.mark.parametrize("flag, text", [("n_layer", "1_0"), ("n_layer", "\u0663"), ("n_layer", "\uff12"),
                                        ("n_layer", "0x10"), ("n_layer", "2.0"), ("lr", "1_0.5"), ("lr", "\u0661e-3")])
def test_numbers_are_plain_ascii_decimals(tmp_path, capsys, flag, text):
    with pytest.raises(SystemExit) as e:
        parse_config([f"--{flag}", text, "--out_dir", str(tmp_path)])
    assert e.value.code == 2 and f"argument --{flag}: invalid" in capsys.readouterr().err


def test_plain_spellings_still_read(tmp_path):
    cfg = parse_config(["--n_layer", " 4 ", "--lr", "2E-3", "--min_lr=.0001", "--seed", "+7",
                        "--out_dir", str(tmp_path)])
    assert (cfg.n_layer, cfg.lr, cfg.min_lr, cfg.seed) == (4, 2e-3, 1e-4, 7)


@pytest.mark.parametrize("argv, parse", [(["--n_l", "2"], parse_config), (["--tp", "2"], parse_config),
                                         (["--num", "4"], lambda a: parse_collectives_args(a, ""))])
def test_a_prefix_or_another_scripts_flag_is_not_a_flag(tmp_path, capsys, argv, parse):
    with pytest.raises(SystemExit) as e:
        parse(argv + ["--out_dir", str(tmp_path)] if parse is parse_config else argv)
    assert e.value.code == 2 and f"unrecognized arguments: {argv[0]}" in capsys.readouterr().err


def test_plan_reads_no_prefix(capsys):
    with pytest.raises(SystemExit) as e:          # --tp was read as --tp_overlap 4, refused as a share
        plan.main(["--model", "gpt2", "--tp", "4"])
    assert e.value.code == 2 and "unrecognized arguments: --tp 4" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------
# integers no run can use; MoE flags that would silently mean a dense model or overflow

@pytest.mark.parametrize("flags, message", [
    (dict(n_layer=10 ** 30), "--n_layer 1000000000000000000000000000000 does not fit in 64 bits"),
    (dict(global_batch_size=2 ** 63), "--global_batch_size 9223372036854775808 does not fit in 64 bits"),
    (dict(max_steps=10 ** 8), "--max_steps must be at most 99,999,999"),
    (dict(eval_iters=10 ** 9), "--eval_iters must be at most 99,999,999"),
    (dict(sample_tokens=10 ** 6), "--sample_tokens must be at most 100,000"),
    (dict(device="cuda:99999999999999999999"), "--device must be auto, cpu, cuda or cuda:N"),
    (dict(n_experts=2, moe_every=7), "--moe_every 7 > --n_layer: no MoE block among the 2"),
    (dict(n_experts=2, capacity_factor=1e308), "--capacity_factor 1e+308 is above --n_experts 2"),
])
def test_integers_no_run_can_use(tiny_data, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:       # parsing only: were it accepted, no model of 10**30 layers is built
        parse_config(tiny_argv(tiny_data, str(tmp_path / "out"), **flags), model_setup.MOE_FLAGS,
                     validate=model_setup.check_moe)
    line = capsys.readouterr().err.strip()
    assert e.value.code == 2 and line.startswith("error: ") and message in line, line


@pytest.mark.parametrize("flags, warnings", [
    (dict(lr=0.5, weight_decay=2.0, min_lr=0.0), ["--lr 0.5 x --weight_decay 2 = 1 >= 1: AdamW multiplies each "
                                                  "decayed weight by 1 - lr x weight_decay = 0 every step"]),
    (dict(lr=1.0, weight_decay=1.5, min_lr=0.0), ["= -0.5 every step, zeroing it or flipping its sign"]),
    (dict(warmup_steps=50, max_steps=10), ["--warmup_steps 50 is longer than the run (--max_steps 10): the learning "
                                           "rate never reaches --lr 0.003 (it ends at 0.0006) and never decays"]),
    (dict(warmup_steps=20, max_steps=20, lr=0.9, weight_decay=1.0), []),     # both just inside: nothing said
])
def test_degenerate_hyperparameters_are_warned_about_with_the_reason(tmp_path, capsys, monkeypatch, flags, warnings):
    parse_config(tiny_argv(str(tmp_path / "data"), str(tmp_path / "out"), **flags))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(warnings) and all(line.startswith("warning: ") and text in line
                                               for line, text in zip(lines, warnings)), lines
    monkeypatch.setenv("RANK", "1")                 # the other ranks have the same flags: rank 0 says it once
    monkeypatch.setenv("WORLD_SIZE", "2")
    parse_config(tiny_argv(str(tmp_path / "data"), str(tmp_path / "out"), **flags))
    assert capsys.readouterr().out == ""


# ----------------------------------------------------------------------------------------------------------
# memory known before work

def test_least_memory_counts_the_model_and_a_micro_batch(tiny_data, tmp_path):
    cfg = parse_config(tiny_argv(tiny_data, str(tmp_path)))
    need, what = startup.least_memory(cfg, 64, torch.float32)
    h, layers = cfg.n_embd, cfg.n_layer
    params = 64 * h + 12 * layers * h * h
    tokens = cfg.micro_batch_size * cfg.block_size
    assert need == 16 * params + tokens * (14 * layers * h + 128) * 4 + 8 * cfg.global_batch_size
    assert f"{params:,} parameters" in what
    moe = parse_config(tiny_argv(tiny_data, str(tmp_path), n_experts=4, moe_every=2), model_setup.MOE_FLAGS)  # 1 of 2
    assert startup.least_memory(moe, 64, torch.float32)[0] - need == 16 * 3 * 8 * h * h


def test_a_run_past_this_hosts_memory_is_refused_naming_its_sizes(tiny_data, tmp_path, monkeypatch):
    cfg = parse_config(tiny_argv(tiny_data, str(tmp_path), n_embd=16384, n_layer=64))
    env = DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
    monkeypatch.setattr(startup, "host_available", lambda: 64 * 2 ** 30)
    message = startup.memory_problem(cfg, env, 64)
    assert "need at least 3,0" in message and "206,159,478,784 parameters" in message and "64.0 GiB" in message
    small = parse_config(tiny_argv(tiny_data, str(tmp_path)))
    assert startup.memory_problem(small, env, 64) is None
    two = DistEnv(0, 2, 0, torch.device("cpu"), "gloo")            # two ranks of one host share its memory
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    need = startup.least_memory(cfg, 64, torch.float32)[0]
    monkeypatch.setattr(startup, "host_available", lambda: need - 1)
    assert startup.memory_problem(cfg, two, 64) is not None


def test_a_model_past_memory_stops_before_it_is_built(tiny_data, tmp_path):
    """Subprocess: before, the allocator's RuntimeError was a traceback (or, a little smaller, minutes of swap)."""
    proc = subprocess.run([sys.executable, "train_single.py", *tiny_argv(tiny_data, str(tmp_path), n_embd=100000,
                                                                         n_layer=100)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: the model and one micro-batch need at least"), proc.stderr


def test_compile_without_its_compiler_is_named_before_the_model_is_built(tiny_data, tmp_path, capsys, monkeypatch):
    """Before, the first step's compile died in a traceback from inductor's C++ build (after the model was built).
    The compiler is set through inductor's own config.patch: monkeypatch's undo would delete the entry (pytest 9
    restores an instance attribute it did not find in __dict__ by deleting it), hiding it from later compiles."""
    from torch._inductor import config as inductor
    with inductor.patch({"cpp.cxx": (None, "no-such-g++")}):
        line = one_error_line(capsys, tiny_argv(tiny_data, str(tmp_path / "out"), compile=True))
        assert line == ("error: --compile on the CPU needs a C++ compiler: torch.compile's inductor runs no-such-g++, "
                        "which is not on PATH (install g++, set CXX to one, or run without --compile)")
        cfg = parse_config(tiny_argv(tiny_data, str(tmp_path / "out"), kernels="compile"))
        assert startup.compiler_problem(cfg, torch.device("cpu")).startswith("--kernels compile on the CPU needs a C++")
    monkeypatch.setenv("PATH", str(tmp_path))                   # a GPU host without cc, gcc or clang
    monkeypatch.delenv("CC", raising=False)
    assert startup.compiler_problem(cfg, torch.device("cuda")).startswith("--kernels compile on the GPU needs a C "
                                                                          "compiler: Triton compiles a launcher")
    monkeypatch.undo()
    with inductor.patch({"cpp.cxx": (None, "g++")}):
        assert startup.compiler_problem(parse_config(tiny_argv(tiny_data, str(tmp_path / "out"))),
                                        torch.device("cpu")) is None


# ----------------------------------------------------------------------------------------------------------
# the launcher's environment

@pytest.mark.parametrize("env, message", [(dict(OMP_NUM_THREADS="0"), "OMP_NUM_THREADS='0' is not a positive"),
                                          (dict(OMP_NUM_THREADS="four"), "OMP_NUM_THREADS='four'"),
                                          (dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="7", LOCAL_WORLD_SIZE="2"),
                                           "LOCAL_RANK=7 with LOCAL_WORLD_SIZE=2")])
def test_launcher_variables_no_launcher_sets(monkeypatch, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        launch_env()


@pytest.mark.parametrize("env, message", [
    (dict(RANK="0"), "RANK=0 is set but not MASTER_ADDR or MASTER_PORT: a RANK left in the shell, not a launch by "
                     "torchrun (which sets them all); unset RANK, or launch with torchrun"),
    (dict(RANK="0", MASTER_ADDR="localhost"), "RANK=0 is set but not MASTER_PORT: a RANK left"),
    (dict(RANK="0", MASTER_ADDR="localhost", MASTER_PORT="29x"), "MASTER_PORT='29x' is not a port number (1..65535)"),
    (dict(RANK="0", MASTER_ADDR="localhost", MASTER_PORT="70000"), "MASTER_PORT='70000' is not a port number"),
])
def test_a_stray_rank_or_master_port_is_named(monkeypatch, env, message):
    """Before, a RANK left in the shell failed as a process group that could not be joined 'within --dist_timeout',
    and a bad MASTER_PORT as int()'s complaint."""
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        rendezvous_problem(0, 5.0)
    assert message in str(e.value)


def test_a_rendezvous_that_never_answers_stops_within_dist_timeout(tiny_data, tmp_path, capsys, monkeypatch):
    """Rank 1 of 2 with no rank 0 listening: one line after --dist_timeout (before, torch's store client printed
    C++ stack frames at each retry); with something listening it goes on."""
    import socket
    import time
    import train_ddp
    from distributed_helper import free_port
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    for name, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(name, value)
    t0 = time.monotonic()
    line = one_error_line(capsys, tiny_argv(tiny_data, str(tmp_path / "out"), dist_timeout=1), train_ddp)
    assert line.startswith(f"error: rank 1: nothing answers at MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port} within "
                           f"--dist_timeout 1 s (") and line.endswith("rank 0 did not start, or MASTER_ADDR/"
                                                                      "MASTER_PORT are wrong"), line
    assert time.monotonic() - t0 < 30
    with socket.create_server(("127.0.0.1", port)):
        assert rendezvous_problem(1, 1.0) is None


def test_collectives_checks_the_launcher_variables_too(monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "0")
    with pytest.raises(SystemExit) as e:
        parse_collectives_args([], "")
    assert e.value.code == 2 and "OMP_NUM_THREADS='0'" in capsys.readouterr().err


def test_launcher_variables_torchrun_sets(monkeypatch):
    for name, value in dict(RANK="1", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="4,2"
                            ).items():
        monkeypatch.setenv(name, value)
    assert launch_env() == (1, 4, 1)


def test_a_configuration_error_is_printed_by_every_rank_of_a_launch(monkeypatch, capsys):
    """Under torchrun the first rank to exit gets the others killed, maybe before they print: so every rank prints
    a configuration error itself (here README's ladder launch with a width its default 6 heads do not divide), and
    the line reaches the terminal whichever rank exits first. A rank that stops because another failed (whose own
    line says why) leaves the saying to rank 0. Then the launch itself, under torchrun: the line, none of our
    frames (only torchrun's own ChildFailedError report)."""
    import train_ddp
    from common.errors import fail_after_another_rank
    monkeypatch.setenv("WORLD_SIZE", "3")
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        with pytest.raises(SystemExit) as e:
            train_ddp.main(["--n_layer", "2", "--n_embd", "64"])
        assert e.value.code == 2 and capsys.readouterr().err == "error: n_embd=64 is not divisible by n_head=6\n"
        with pytest.raises(SystemExit) as e:
            fail_after_another_rank("another rank failed")
        assert e.value.code == 2 and capsys.readouterr().err == ("error: another rank failed\n" if rank == 0 else "")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "train_ddp.py",
                           "--n_layer", "2", "--n_embd", "64"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    both = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "error: n_embd=64 is not divisible by n_head=6\n" in both, both
    ours = [line for line in both.splitlines() if f'File "{ROOT}' in line and "site-packages" not in line]
    assert not ours and "ChildFailedError" in both, both  # torch may be installed under ROOT (a .venv there)


# ----------------------------------------------------------------------------------------------------------
# data files

def dataset(path):
    return make_tiny_dataset(str(path))


def test_a_token_file_that_is_a_pipe_is_refused_not_waited_on(tmp_path):
    data_dir = dataset(tmp_path / "data")
    os.remove(os.path.join(data_dir, "train.bin"))
    fifo = os.path.join(data_dir, "train.bin")
    os.mkfifo(fifo)                                     # opening it blocks until a writer comes:
    writer = threading.Timer(10, lambda: open(fifo, "wb").close())     # one comes, should the test fail
    writer.daemon = True
    writer.start()
    try:
        with pytest.raises(ValueError, match="train.bin: not a regular file"):
            data.GlobalBatchLoader(data_dir, 16, 8, 0)
    finally:
        writer.cancel()


@pytest.mark.parametrize("damage, message", [
    ("uint32", "train.bin holds 40,000 uint16 tokens, but"),
    ("dangling", "train.bin: a symbolic link to"),
    ("meta dir", "meta.json: a directory, not a file"),
    ("vocab true", "needs vocab_size, an integer in 1..65536 (token ids are uint16), got True"),
    ("count string", "train_tokens must be a count of tokens, got '20000'"),
])
def test_a_damaged_data_directory_is_one_line_naming_the_file(tmp_path, capsys, damage, message):
    data_dir = dataset(tmp_path / "data")
    train, meta_path = os.path.join(data_dir, "train.bin"), os.path.join(data_dir, "meta.json")
    meta = json.load(open(meta_path))
    if damage == "uint32":          # small ids of another width read as valid uint16 ids: only the count tells
        np.fromfile(train, dtype=np.uint16).astype(np.uint32).tofile(train)
    elif damage == "dangling":
        os.remove(train)
        os.symlink(str(tmp_path / "nowhere"), train)
    elif damage == "meta dir":
        os.remove(meta_path)
        os.makedirs(meta_path)
    else:
        meta.update({"vocab true": dict(vocab_size=True), "count string": dict(train_tokens="20000")}[damage])
        json.dump(meta, open(meta_path, "w"))
    line = one_error_line(capsys, tiny_argv(data_dir, str(tmp_path / "out")))
    assert message in line, line


def test_prepare_refuses_a_pipe_and_dangling_links(tmp_path, capsys):
    os.mkfifo(tmp_path / "pipe")
    os.symlink(str(tmp_path / "nowhere"), tmp_path / "link")
    for argv, message in ((["--input", str(tmp_path / "pipe")], "not a regular file"),
                          (["--input", str(tmp_path / "link")], "a symbolic link to"),
                          (["--input", "README.md", "--out_dir", str(tmp_path / "link")], "--out_dir")):
        with pytest.raises(SystemExit) as e:
            data.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and message in err, err


def test_data_mix_refuses_an_out_dir_it_cannot_use(tmp_path, capsys):
    """python -m common.data_mix, an entry point of its own: an --out_dir that is empty, a file, under a file or a
    dangling link is one error line naming it, before any of its three corpora is prepared."""
    from common import data_mix
    (tmp_path / "file").write_text("x")
    os.symlink(str(tmp_path / "nowhere"), tmp_path / "link")
    for out_dir in ("", str(tmp_path / "file"), str(tmp_path / "file" / "under"), str(tmp_path / "link")):
        with pytest.raises(SystemExit) as e:
            data_mix.main(["--out_dir", out_dir])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: --out_dir") and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["file", "link"]


# ----------------------------------------------------------------------------------------------------------
# bench.sh: its arguments and knobs before it installs, prepares or runs anything

@pytest.mark.parametrize("argv, env, message", [
    ([], {}, "name a sweep"), (["nosuch"], {}, "no sweep named 'nosuch'"), (["../README"], {}, "no sweep named"),
    (["list", "single"], {}, "no sweep named 'list'"), (["single"], dict(STEPS="1e3"), "STEPS=1e3 must be a whole"),
    (["single"], dict(REPEATS="0"), "at least one round"), (["single"], dict(STEPS="4", WARMUP="5"), "must exceed"),
])
def test_bench_sh_checks_its_arguments_first(argv, env, message):
    proc = subprocess.run(["bash", "bench.sh", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHON="false", **env))    # any work would fail: none is done
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""


@pytest.mark.parametrize("what, message", [("metrics.jsonl", "metrics.jsonl is not a regular file"),
                                           ("run.lock", "run.lock is not a regular file"),
                                           ("ckpt", "ckpt is a symbolic link that does not resolve")])
def test_out_dir_files_that_are_pipes_or_dangling_links(tmp_path, capsys, what, message):
    """A pipe blocked the run's first open (metrics) for ever; a dangling ckpt link failed the first save, after
    the training."""
    out = tmp_path / "out"
    os.makedirs(out)
    if what == "ckpt":
        os.symlink(str(tmp_path / "nowhere"), out / what)
    else:
        os.mkfifo(out / what)
    with pytest.raises(SystemExit) as e:
        parse_config(["--out_dir", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: --out_dir") and message in err, err


# ----------------------------------------------------------------------------------------------------------
# a run stopped from outside: Ctrl-C, a full disk under metrics.jsonl

@pytest.fixture(scope="module")
def two_steps(tiny_data, tmp_path_factory):
    """OUT_DIR of a finished 2-step run: its checkpoint is step 2's."""
    out = str(tmp_path_factory.mktemp("two_steps") / "out")
    run_single(tiny_argv(tiny_data, out, max_steps=2))
    return out


def test_ctrl_c_is_one_line_saying_what_the_run_keeps(two_steps, tmp_path, capsys, monkeypatch):
    """Before: a KeyboardInterrupt traceback per rank, and no word on which checkpoint survived. In a process (as
    every run does from prepare_data on): SIGINT, then a collective failing because a peer stopped on its own
    Ctrl-C, reaches the top; the line says what the run keeps. Then the hook alone: the same line for a plain
    KeyboardInterrupt, nothing from rank 1, any other error left to the previous hook. (Ctrl-C at each start-up
    phase of each entry point: tests/test_ctrl_c.py.)"""
    script = (f"import functools, os, signal, sys, time; sys.path.insert(0, {ROOT!r})\n"
              f"from common.checkpoint.files import kept_checkpoint\n"
              f"from common.errors import report_interrupts\n"
              f"signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # Python default (parent may ignore it)
              f"report_interrupts(kept=functools.partial(kept_checkpoint, {two_steps!r}), rank=0)\n"
              f"try:\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(5)\n"
              f"except KeyboardInterrupt:\n    raise RuntimeError('Connection closed by peer')")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    line = (f"interrupted: {two_steps} keeps the checkpoint of step 2: run the same command with --resume to "
            f"continue from it\n")
    assert proc.stderr == line and proc.returncode != 0, proc.stderr
    others = []
    monkeypatch.setattr(errors, "INTERRUPT", dict(kept=lambda: line[len("interrupted: "):-1], rank=0,
                                                  interrupted=False))
    errors.on_exit_exception(lambda *exc: others.append(exc[0]), KeyboardInterrupt, KeyboardInterrupt(), None)
    errors.on_exit_exception(lambda *exc: others.append(exc[0]), ValueError, ValueError(), None)
    assert capsys.readouterr().err == line and others == [ValueError]
    errors.INTERRUPT.update(rank=1)
    errors.on_exit_exception(lambda *exc: others.append(exc[0]), KeyboardInterrupt, KeyboardInterrupt(), None)
    assert capsys.readouterr().err == "" and others == [ValueError]


def test_a_full_disk_under_metrics_is_one_line(two_steps, tiny_data, tmp_path, capsys, monkeypatch):
    import errno
    from common import metrics

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")
    out = str(tmp_path / "out")
    shutil.copytree(two_steps, out)
    real_init = metrics.MetricsLogger.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.file.close()
        self.file = FullDisk()
    monkeypatch.setattr(metrics.MetricsLogger, "__init__", init)
    line = one_error_line(capsys, tiny_argv(tiny_data, out, max_steps=4, resume="yes"))
    assert line == (f"error: cannot write {out}/metrics.jsonl (ENOSPC: No space left on device); {out} keeps the "
                    f"checkpoint of step 2: run the same command with --resume to continue from it once there is space")
