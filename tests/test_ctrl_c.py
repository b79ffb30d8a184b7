"""
A Ctrl-C in start-up phases of each kind of entry point (a rung, plan.py, collectives.py, train_single, python -m
common.data, common.data_mix, common.hf): one `interrupted:` line saying what was kept, no traceback, and the end
Python gives an uncaught KeyboardInterrupt (death by SIGINT: a shell says 130). Each case sends the SIGINT itself at
a chosen point (the import of torch, the rendezvous, the corpus's preparation, a dataset's write), not after a
guessed sleep. Before, a Ctrl-C before prepare_data (where the report began) was a traceback, and so was one in
the data and export command lines.
"""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from train_helpers import make_tiny_dataset, tiny_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs an entry point (a script, or -m MODULE) as `python` would, after arranging for a SIGINT at `where`: the import
# of a module (import:NAME) or the first call of a function or method (MODULE:ATTRIBUTE[.ATTRIBUTE]).
DRIVER = f"""
import importlib, os, runpy, signal, sys, time
sys.path.insert(0, {ROOT!r})
signal.signal(signal.SIGINT, signal.default_int_handler)    # Python's default (a test runner may ignore SIGINT)
where, entry, argv = sys.argv[1], sys.argv[2], sys.argv[3:]

def ctrl_c(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)                     # raised here, as KeyboardInterrupt, at once
    time.sleep(60)                                          # (or at the latest here, which it interrupts)

class CtrlCAtImport:
    def find_spec(self, name, path=None, target=None):
        if name == where[len("import:"):]:
            ctrl_c()

if where.startswith("import:"):
    sys.meta_path.insert(0, CtrlCAtImport())
else:
    module, attributes = where.split(":")
    owner = importlib.import_module(module)
    *path, name = attributes.split(".")
    for attribute in path:
        owner = getattr(owner, attribute)
    setattr(owner, name, ctrl_c)
sys.argv = [entry] + argv
if entry.startswith("-m"):
    runpy.run_module(entry[2:], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(os.path.join({ROOT!r}, entry), run_name="__main__")
"""


def interrupted(where, entry, argv, cwd):
    """(stderr lines other than warnings, exit status) of `entry` interrupted at `where`."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", DRIVER, where, entry, *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    return [line for line in proc.stderr.splitlines() if not line.startswith("warning: ")], proc.returncode


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ctrl_c") / "data")
    make_tiny_dataset(path)
    return path


NOTHING = "nothing was written"
FRESH = "no checkpoint in {out} yet: a new run starts from step 0"     # once the run has taken its out_dir

# entry point, where the SIGINT lands (the phase), its arguments (RUN: a tiny run on the test corpus), the line's end
CASES = {"imports of a rung": ("train_zero.py", "import:torch", "RUN", NOTHING),
         "imports of plan.py": ("plan.py", "import:torch", ["--gpus", "8"], NOTHING),
         "imports of python -m": ("-mcommon.hf", "import:torch", ["export", "out", "hf"], NOTHING),
         "rendezvous": ("collectives.py", "common.distributed:init_distributed", ["--numel", "1000"], NOTHING),
         "corpus preparation": ("train_single.py", "common.data:prepare_stdlib", "DEFAULT CORPUS", FRESH),
         "a mixture's corpora": ("-mcommon.data_mix", "common.data:prepare_stdlib", ["--out_dir", "mix"],
                                 "no dataset was written to mix/stdlib")}


@pytest.mark.parametrize("phase", list(CASES))
def test_ctrl_c_at_start_up_is_one_line(phase, corpus, tmp_path):
    entry, where, argv, kept = CASES[phase]
    out = str(tmp_path / "out")
    if argv in ("RUN", "DEFAULT CORPUS"):        # the default corpus: data/stdlib, prepared on first use, here
        argv = tiny_argv(corpus if argv == "RUN" else "data/stdlib", out, max_steps=2)
    lines, code = interrupted(where, entry, argv, cwd=str(tmp_path))
    assert lines == [f"interrupted: {kept.format(out=out)}"] and code == -signal.SIGINT, (lines, code)
    assert os.listdir(tmp_path) in (["out"], ["mix"], []), os.listdir(tmp_path)    # no corpus half-prepared


def test_ctrl_c_while_a_dataset_is_written_keeps_the_one_there(tmp_path):
    """python -m common.data over a prepared directory, stopped while it writes the new meta.json: the temporary
    files are removed and the dataset there is byte for byte the one it was."""
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 40)
    out = str(tmp_path / "data")
    make_tiny_dataset(out)
    before = {name: open(os.path.join(out, name), "rb").read() for name in sorted(os.listdir(out))}
    lines, code = interrupted("json:dump", "-mcommon.data", ["--input", str(text), "--out_dir", out], cwd=ROOT)
    assert lines == [f"interrupted: nothing in {out} was changed"] and code == -signal.SIGINT, lines
    assert {name: open(os.path.join(out, name), "rb").read() for name in sorted(os.listdir(out))} == before
    assert np.fromfile(os.path.join(out, "train.bin"), dtype=np.uint16).size > 0
