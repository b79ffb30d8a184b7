"""bench/failure_battery.py, the rerunnable failure battery: a few cheap cases classify as they must,
and the classifier does report the bad classes (fake scripts that raise or hang), so the battery can fail."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def outcomes(table):
    """{case name: outcome} from the battery's markdown table (bad outcomes are in bold)."""
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    return {cells[1]: cells[2].strip("*") for cells in rows}


def test_the_battery_classifies_cheap_cases_and_reports_bad_ones(tmp_path):
    results = tmp_path / "failures.md"
    cmd = [sys.executable, "bench/failure_battery.py", "--selfcheck", "--only", "selfcheck",
           "--only", "train_single: --lr -1", "--only", "train_single: --stop_step 8", "--results", str(results)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]      # bad cases found: exit 1
    table = results.read_text()
    assert outcomes(table) == {"train_single: --lr -1": "clean error",
                               "train_single: --stop_step 8 --max_steps 5": "clean error",
                               "selfcheck: a script that raises": "traceback",
                               "selfcheck: a script that prints one error line": "clean error",
                               "selfcheck: a script that sleeps": "hang"}, table
    assert "| traceback | 1 |" in table and "| hang | 1 |" in table and "| clean error | 3 |" in table
    assert "RuntimeError: a deliberate failure" in table and table in proc.stdout
