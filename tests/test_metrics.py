"""metrics.py's and peaks.py's two machine-dependent numbers: the peak memory of each step (reset after every logged row, not the
process's lifetime peak) and the CPU's peak FLOP/s for MFU (measured once per machine and thread count, then read
back, so that every run on a machine divides by the same number)."""
import json
import os
import platform
import types

import pytest
import torch

from common import metrics, peaks


def logger_for(tmp_path):
    cfg = types.SimpleNamespace(out_dir=str(tmp_path), log_interval=100, stop_step=0, max_steps=10, profile=0)
    env = types.SimpleNamespace(rank=0, device=torch.device("cpu"))
    return metrics.MetricsLogger(cfg, env, flops_per_token=1.0, n_devices=1, tokens_per_step=1)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="resetting the peak RSS needs Linux")
def test_peak_memory_is_per_step(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "device_peak_flops", lambda device: 1e9)
    logger = logger_for(tmp_path)
    big = torch.ones(64 * 2 ** 20 // 4)          # 64 MiB, touched: a peak inside step 0, freed before its row
    del big
    first = logger.log_step(0, 1.0, 1e-3, 1.0, 0.1, 0)["peak_mem_bytes"]
    second = logger.log_step(1, 1.0, 1e-3, 1.0, 0.1, 0)["peak_mem_bytes"]
    logger.close()
    assert first - second > 48 * 2 ** 20, f"step 0 peaked at {first} bytes, step 1 at {second}: not reset per step"


def test_cpu_peak_is_measured_once_per_machine(tmp_path, monkeypatch):
    path = str(tmp_path / "cache" / "cpu_peak_flops.json")
    calls = []
    monkeypatch.setattr(peaks, "measure_cpu_matmul_flops", lambda repeats: calls.append(repeats) or 5e10)
    assert peaks.machine_cpu_peak_flops(path) == 5e10 and len(calls) == 1
    assert peaks.machine_cpu_peak_flops(path) == 5e10 and len(calls) == 1       # read back, not measured
    with open(path) as f:
        (key, value), = json.load(f).items()
    assert platform.node() in key and f"{torch.get_num_threads()} threads" in key and value == 5e10
    monkeypatch.setattr(torch, "get_num_threads", lambda: 977)                       # other threads: measured
    assert peaks.machine_cpu_peak_flops(path) == 5e10 and len(calls) == 2
    with open(path) as f:
        assert len(json.load(f)) == 2


def test_cpu_peak_without_a_writable_cache_still_measures(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")                       # a file where the cache's folder would be
    monkeypatch.setattr(peaks, "measure_cpu_matmul_flops", lambda repeats: 7e9)
    assert peaks.machine_cpu_peak_flops(str(blocked / "sub" / "peak.json")) == 7e9


def test_cpu_peak_at_fewer_threads_is_bounded_by_more_threads(tmp_path, monkeypatch):
    """A one-thread figure measured while four ranks shared two cores (a quarter of the truth) is raised to half
    the two-thread peak: k threads never do more than k times one thread's work, so MFU cannot read 2-3x too high."""
    path = str(tmp_path / "peak.json")
    machine = f"{platform.node()} | {peaks.cpu_model()}"
    with open(path, "w") as f:
        json.dump({f"{machine} | 2 threads": 1.4e11, f"{machine} | 1 threads": 2.5e10,
                   f"another host | {peaks.cpu_model()} | 8 threads": 9e12, "not a key": "x"}, f)
    monkeypatch.setattr(peaks, "measure_cpu_matmul_flops", lambda repeats: pytest.fail("measured again"))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert peaks.machine_cpu_peak_flops(path) == 7e10                 # 1.4e11 / 2, not 2.5e10, not the other host's
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert peaks.machine_cpu_peak_flops(path) == 1.4e11               # a larger count is never lowered


def test_a_stale_cpu_peak_never_gives_an_mfu_above_100_percent(tmp_path, monkeypatch, capsys):
    """A cached CPU peak measured under load (1e3 FLOP/s), and the machine still busy when measured again (2e3): a
    step achieving 1e4 FLOP/s per device reports MFU 100%, not 1000%, the progress line says the peak is a CPU
    estimate, and the file keeps the raised peak for later runs (which divide by it without measuring)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _, key = peaks.cpu_peak_key()
    peaks.write_cpu_peaks(peaks.cpu_peak_file(), {key: 1e3})
    measured = []
    monkeypatch.setattr(peaks, "measure_cpu_matmul_flops", lambda repeats: measured.append(repeats) or 2e3)
    cfg = types.SimpleNamespace(out_dir=str(tmp_path), log_interval=1, stop_step=0, max_steps=10, profile=0)
    env = types.SimpleNamespace(rank=0, device=torch.device("cpu"))
    logger = metrics.MetricsLogger(cfg, env, flops_per_token=100.0, n_devices=2, tokens_per_step=200)
    assert logger.log_step(0, 1.0, 1e-3, 1.0, 1.0, 0)["mfu"] == 1.0 and len(measured) == 1   # 2e4 over 2 devices
    assert logger.log_step(1, 1.0, 1e-3, 1.0, 2.0, 0)["mfu"] == 0.5 and len(measured) == 1   # the raised peak
    logger.close()
    assert "| MFU 100.0% (CPU peak est.) |" in capsys.readouterr().out
    assert peaks.read_cpu_peaks(peaks.cpu_peak_file())[key] == 1e4 == peaks.machine_cpu_peak_flops()


@pytest.mark.parametrize("script, flags", [("train_tp", dict(tp=1)), ("train_cp", dict(cp=1))])
def test_saved_activations_are_counted_in_the_first_micro_batch_only(tiny_data, tmp_path, monkeypatch, script, flags):
    """The act_bytes of a step are one micro-batch's (all are alike): the saved-tensor hook, which runs on every
    tensor autograd keeps, is installed for the first micro-batch of each step and no other (4 of them here)."""
    import importlib
    from train_helpers import tiny_argv
    entered, enter = [], metrics.SavedActivationBytes.__enter__
    monkeypatch.setattr(metrics.SavedActivationBytes, "__enter__", lambda self: entered.append(1) or enter(self))
    argv = tiny_argv(tiny_data, str(tmp_path), max_steps=2, global_batch_size=8, micro_batch_size=2, **flags)
    importlib.import_module(script).main(argv)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(entered) == 2 and all(r["act_bytes"] > 0 for r in rows if "loss" in r), (entered, rows)


def test_action_timer_idle_share_and_median_costs():
    """The pipeline timer on a host clock: busy = the actions' spans, idle = the rest of the step, and costs() the
    median duration of each kind (the F:B:W the bubble is simulated at), 0 for a kind the step has none of."""
    from pipeline.schedules import Action, simulate
    from train_pp import make_schedule
    clock = iter([0.0,                                     # start
                  1.0, 2.0, 2.5, 5.5, 6.0, 7.0, 7.0, 10.0,  # F (1 s), B (3 s), F (1 s), B (3 s), waits between
                  12.0])                                   # stop
    timer = metrics.ActionTimer(torch.device("cpu"))
    timer.mark = lambda: next(clock)                      # the host clock's readings, in order
    timer.start()
    for kind in "FBFB":
        with timer(Action(kind, 0, 0)):
            pass
    timer.stop()
    assert timer.idle_fraction() == pytest.approx(1 - 8 / 12)
    assert timer.costs() == dict(f=1.0, b=3.0, w=0.0)
    # at F:B = 1:3 (no W: B is the whole backward) 1f1b's bubble is still (p-1)/(m+p-1): the ratio moves where
    # the idle falls, not its share
    sim = simulate(make_schedule("1f1b", 2, 4), 2, 1, **timer.costs())
    assert sim["idle_share"] == [pytest.approx(1 / 5)] * 2 and sim["makespan"] == 4 * 4 + 4
