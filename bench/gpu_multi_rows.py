"""
bench/gpu_multi_rows.py: the rows of bench/gpu_check.py that need several GPUs and NCCL (gpu_check adds them only
where it sees more than one), each a subcommand that writes its sub-rows as JSON, as bench/gpu_rows.py does:

    python3 bench/gpu_multi_rows.py stalled_save P OUT.json   # a rank stalled inside a save past --dist_timeout
    python3 bench/gpu_multi_rows.py startup P OUT.json        # train_5d's start-up time at P ranks

stalled_save: train_ddp on P GPUs saving after every step, --dist_timeout 20. Once a save is under way (a temporary
file exists), the last rank is stopped (SIGSTOP) and left stopped. NCCL's watchdog aborts the other ranks'
communicators without raising where they wait; the save's commit decides on a gloo group (common/distributed.py),
which raises. ok: every other rank ends within --dist_timeout + MARGIN_S with one `error:` line, and `latest` names
a complete checkpoint (every part its ckpt.pt lists is there), the one before the stalled save.
startup: train_5d at gpu_check_rows.grid_5d(P) for one step: seconds from the launch to its first metrics row (the
process group, every grid group, the model and the first step), for the largest world gpu_check uses.
DEVICE is "cuda"; a test runs both on CPU with gloo by changing it.
"""
import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
from failure_runs import (Job, checkpoint_problem, error_lines, latest_step_dir, steps_logged,  # noqa: E402
                          temp_files, wait_until)
from gpu_check_rows import data_dir, grid_5d  # noqa: E402
from common.config import argv_of  # noqa: E402

DEVICE = "cuda"
DIST_TIMEOUT_S = 20
MARGIN_S = 60
MODEL = dict(n_layer=8, n_head=8, n_embd=512, block_size=256, micro_batch_size=2, warmup_steps=2, lr=6e-4,
             min_lr=6e-5, eval_interval=0, sample_tokens=0, log_interval=1, seed=1234)


def argv(out, data, world, **flags):
    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    return argv_of({**MODEL, "global_batch_size": 2 * world, "device": DEVICE, "dtype": dtype, "data_dir": data,
                    "out_dir": out, **flags})


def stalled_save(world, out, data):
    run = os.path.join(out, "run")
    job = Job.launch("train_ddp.py", world, argv(run, data, world, max_steps=1000, save_interval=1,
                                                 dist_timeout=DIST_TIMEOUT_S), out, "stalled")
    caught = wait_until(lambda: temp_files(run) and latest_step_dir(run), job, 600, interval=0.002)
    before = os.path.basename(latest_step_dir(run) or "none")
    victim = world - 1
    job.signal(victim, signal.SIGSTOP)
    t0 = time.time()
    survivors = list(range(victim))
    result = job.wait(DIST_TIMEOUT_S + MARGIN_S, survivors)
    seconds = time.time() - t0
    problem = checkpoint_problem(run)
    lines = [error_lines(result.errs[r]) for r in survivors]
    ended = not result.hung and all(result.codes[r] not in (0, None) and len(lines[r]) == 1 for r in survivors)
    check = (f"stopped during a save (latest {before}); the other {victim} rank(s) ended in {seconds:.0f} s "
             f"({'one error line each' if ended else f'exit {result.codes[:victim]}, hung {result.hung}'}); "
             f"checkpoint: {problem or 'complete, ' + os.path.basename(latest_step_dir(run))}")
    return dict(name=f"rank {victim} of {world} stalled inside a save", ok=bool(caught and ended and not problem),
                check=check if caught else "no save caught under way: " + check, speed="-")


def startup(world, out, data):
    run = os.path.join(out, "run")
    t0 = time.time()
    job = Job.launch("train_5d.py", world, argv(run, data, world, max_steps=1, **grid_5d(world)), out, "startup")
    logged = wait_until(lambda: steps_logged(run) >= 1, job, 600, interval=0.05)
    seconds = time.time() - t0
    result = job.wait(120)
    layout = " ".join(f"{k}={v}" for k, v in grid_5d(world).items())
    ok = logged and not any(result.codes)
    return dict(name=f"train_5d start-up at {world} ranks ({layout})", ok=bool(ok),
                check=f"launch to the first step's metrics row: {seconds:.1f} s" + ("" if ok else
                                                                                 f"; exit {result.codes}"),
                speed=f"{seconds:.1f} s")


def main(argv_=None):
    args = sys.argv[1:] if argv_ is None else argv_
    rows = dict(stalled_save=stalled_save, startup=startup)
    if len(args) != 3 or args[0] not in rows or not args[1].isdigit() or int(args[1]) < 2:
        print(f"usage: gpu_multi_rows.py {{{','.join(rows)}}} WORLD(>=2) OUT.json", file=sys.stderr)
        return 2
    path = os.path.abspath(args[2])
    out = os.path.join(os.path.dirname(path), os.path.basename(path).rsplit(".", 1)[0])
    os.makedirs(out, exist_ok=True)
    row = rows[args[0]](int(args[1]), out, data_dir(os.path.dirname(path)))
    with open(path, "w") as f:
        json.dump(dict(rows=[row]), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
