"""README.md's commands, read from README itself and run as written, each held to what README promises of it: the
quick start's two lines, the ladder's launches, the GPU check's line and the plan.py lines. Three departures, each
stated where it happens: a command that trains runs fewer steps (QUICK_STEPS, LADDER_STEPS); torchrun is replaced by
this suite's gloo workers (the same environment variables, tests/distributed_helper.py), and a python command runs
on one thread (OMP_NUM_THREADS=1, as torchrun sets it: a shared machine's cores are not all this test's); pip is not
run (the test environment is the installed one). README's test command itself (`python -m pytest`) is this suite."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from distributed_helper import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK_STEPS = 60        # of the quick start's 1000: the loss falls from ~5.5 (to ~3), not yet to README's 2.0
MIX_STEPS = 10          # of the second line's 1000: enough for a sample and the per-source counts
LADDER_STEPS = 2        # of the 200 README's CPU-sized flags give


def readme_section(title):
    text = open(os.path.join(ROOT, "README.md")).read()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def bash_block(section):
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1).strip().splitlines()


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A directory that looks like a fresh checkout from inside (every top-level entry of the repository linked)
    but has its own data/ and out/: README's relative paths resolve here, and nothing is written into the repo."""
    root = tmp_path_factory.mktemp("checkout")
    for name in os.listdir(ROOT):
        if name not in ("data", "out") and not name.startswith("."):
            os.symlink(os.path.join(ROOT, name), root / name)
    return root


def run_line(line, cwd, max_steps=None):
    """One README line, its `&&`-joined commands in turn: `pip install` skipped, `python` this interpreter,
    `--max_steps` replaced by max_steps where it trains. Returns the last command's stdout."""
    out = ""
    for command in line.split(" && "):
        argv = shlex.split(command)
        if argv[:2] == ["pip", "install"]:
            assert all(os.path.isfile(os.path.join(ROOT, a)) for a in argv[2:] if not a.startswith("-")), argv
            continue
        assert argv[0] == "python", argv
        if max_steps is not None and "--max_steps" in argv:
            argv[argv.index("--max_steps") + 1] = str(max_steps)
        proc = subprocess.run([sys.executable] + argv[1:], cwd=cwd, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (command, proc.stdout[-2000:], proc.stderr)
        out = proc.stdout
    return out


def sample_of(stdout):
    assert "---- sample ----\n" in stdout, stdout[-2000:]
    return stdout.split("---- sample ----\n")[1].split("\n----------------")[0]


def rows(out_dir):
    return [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]


def test_the_quick_start_lines_train_and_print_a_sample(sandbox):
    """Line 1 (its corpus prepared on first use): the loss starts at ~5.5 and falls, a sample of text is printed.
    Line 2 (the three corpora prepared, then a mixture): a sample, and per-source counts in metrics.jsonl."""
    section = readme_section("Quick start")
    assert "falls from ~5.5 to below 2.0" in section and "sample of Python-like text is printed" in section
    first, second = bash_block(section)
    sample = sample_of(run_line(first, sandbox, QUICK_STEPS))
    losses = [r["loss"] for r in rows(sandbox / "out" / "train_single") if "loss" in r]     # its default out_dir
    assert len(losses) == QUICK_STEPS and 5.2 < losses[0] < 5.8 and max(losses[-10:]) < 3.5, losses
    assert len(sample) > 100 and "cannot decode" not in sample, sample
    sample = sample_of(run_line(second, sandbox, MIX_STEPS))
    assert len(sample) > 100 and "cannot decode" not in sample, sample
    last = [r for r in rows(sandbox / "out" / "mix") if "loss" in r][-1]
    assert set(last["tokens_by_source"]) == {"data/stdlib", "data/docstrings", "data/stdlib_text"}, last


def _launch(rank, world_size, script, argv, cwd):
    """A worker: `script`.main(argv) as torchrun would start it in cwd; collectives.py's returns nothing."""
    import importlib
    os.chdir(cwd)
    importlib.import_module(script).main(argv)
    return rank


def test_every_ladder_launch_runs_cpu_sized_with_the_flags_readme_gives(sandbox):
    """Each launch of the ladder's table, with the CPU-sized flags README gives below it (and LADDER_STEPS of their
    200 steps), on as many gloo workers as its --nproc_per_node: it trains, its metrics are finite."""
    section = readme_section("The ladder")
    cpu_flags = re.search(r";\s+`(--n_layer [^`]*)` makes any of them a CPU run", section).group(1).split()
    cpu_flags[cpu_flags.index("--max_steps") + 1] = str(LADDER_STEPS)
    launches = re.findall(r"^\| \d+ \| `[^`]+` \|.*\| `((?:torchrun|python) [^`]*)` \|$", section, re.M)
    assert len(launches) == 10, launches          # 2 to 11 but model.py's row ("imported")
    for launch in launches:
        argv = shlex.split(launch)
        if argv[0] == "python" and argv[1] == "plan.py":
            continue                                # not a training run: test_the_plan_lines
        world = int(argv[1].split("=")[1]) if argv[0] == "torchrun" else 1
        script, args = (argv[2], argv[3:]) if argv[0] == "torchrun" else (argv[1], argv[2:])
        name = script[:-len(".py")]
        out = sandbox / "out" / "ladder" / name           # (out/train_single is the quick start's)
        if name != "collectives":
            args += cpu_flags + ["--out_dir", str(out)]
        run_workers(_launch, world, args=(name, args, str(sandbox)), timeout=600)
        if name != "collectives":
            losses = [r["loss"] for r in rows(out) if "loss" in r]
            assert len(losses) == LADDER_STEPS and all(5.0 < x < 6.0 for x in losses), (launch, losses)


def test_the_gpu_check_line_and_the_rows_its_budget_leaves_out():
    """Here, without a GPU, README's gpu_check line skips in one line (exit 0); with --dry it lists the rows, and
    the budget README gives leaves out only the rows README says it leaves out (by their estimates)."""
    section = readme_section("GPUs")
    line, = bash_block(section)
    argv = shlex.split(line.replace("DIR", "out/gpu_check_readme"))
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if shutil.which("nvidia-smi") is None:
        assert proc.returncode == 0 and proc.stdout.startswith("gpu_check: skipped"), proc.stdout + proc.stderr
    proc = subprocess.run(argv + ["--dry"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    left_out = re.findall(r"^  (\S+) +not run \((?:budget|\S+, its reference)", proc.stdout, re.M)
    named = [p for only in re.findall(r"`--only ([^`]+)`", section) for p in only.split(",")]  # row-name prefixes
    assert "kernel-tests" in left_out and all(any(r.startswith(p) for p in named) for r in left_out), \
        (named, proc.stdout)


def test_the_plan_lines_print_what_readme_cites():
    """The ladder's plan.py line prints its layouts and a launch line; the GPU table's plan.py figures are what
    `python bench/gpu_check_rows.py plan h200` prints."""
    plan_line = re.search(r"`(python plan\.py [^`]*)`", readme_section("The ladder")).group(1)
    out = run_line(plan_line, ROOT)
    assert re.search(r"\d+ of \d+ layouts fit", out) and "\ntorchrun --nnodes 8 --nproc_per_node 8 train_5d.py" in out
    row = next(r for r in readme_section("GPUs").splitlines() if r.startswith("| plan.py peak memory"))
    command = re.search(r"`(python bench/gpu_check_rows\.py plan h200)`", row).group(1)
    printed = re.findall(r"allocated (\d+\.\d\d) GiB", run_line(command, ROOT))
    cited = re.findall(r"(\d+\.\d\d) / \d+\.\d\d", row)
    assert printed and sorted(printed) == sorted(cited), (printed, row)
