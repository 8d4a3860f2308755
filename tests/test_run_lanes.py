"""The lanes of `make test` (tests/run_lanes.py): a test marked fault_lane is in a folder the faults
lane runs (elsewhere no lane would run it)."""

from __future__ import annotations

from pathlib import Path

from run_lanes import FAULT_DIRS, failures

TESTS = Path(__file__).resolve().parent


def test_fault_lane_marks_only_tests_the_faults_lane_runs() -> None:
    marked = [p.relative_to(TESTS.parent).as_posix() for p in TESTS.rglob("test_*.py")
              if p.resolve() != Path(__file__).resolve() and "mark.fault_lane" in p.read_text()]
    assert marked, "no test is marked fault_lane: the check sees nothing"
    assert [m for m in marked if not m.startswith(FAULT_DIRS)] == []



def test_a_lanes_failures_are_its_short_summary_lines(tmp_path: Path) -> None:
    log = tmp_path / "jobs.log"
    log.write_text("....F.E\nFAILED in the middle of a traceback is not a summary\n"
                   "=========================== short test summary info ============================\n"
                   "FAILED tests/a.py::test_x - AssertionError: 3 != 4\n"
                   "ERROR tests/b.py::test_y - RuntimeError: port in use\n"
                   "1 failed, 5 passed, 1 error in 9.00s\n")
    assert failures(log) == ["FAILED tests/a.py::test_x - AssertionError: 3 != 4",
                             "ERROR tests/b.py::test_y - RuntimeError: port in use"]
    assert failures(tmp_path / "missing.log") == []


BURN = ("import time\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.3: pass\n")


def test_a_lanes_cpu_counts_its_reaped_children() -> None:
    import subprocess
    import sys
    import time

    from run_lanes import reap

    # The lane's process runs a child that burns 0.3 s of CPU, reaps it, and exits 3.
    proc = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys\n"
                             f"subprocess.run([sys.executable, '-c', {BURN!r}])\nsys.exit(3)"])
    deadline = time.monotonic() + 120
    while (ended := reap(proc)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended is not None and ended[0] == 3 and proc.returncode == 3
    assert ended[1] >= 0.3, ended


def test_the_cpu_plugin_lists_the_tests_that_cost_most(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "test_two.py").write_text(
        "import subprocess, sys\n"
        f"def test_burns_in_a_child():\n    subprocess.run([sys.executable, '-c', {BURN!r}])\n"
        "def test_idle():\n    pass\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.cpu_time", "--cpu-durations=1",
                          "-p", "no:cacheprovider", str(tmp_path)], cwd=TESTS.parent, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if "most CPU: 1 tests of 2" in line)
    cost, _, nodeid = lines[head + 1].strip().partition(" CPU-s  ")
    assert nodeid.endswith("test_two.py::test_burns_in_a_child") and float(cost) >= 0.3, lines[head:head + 2]


def test_the_machines_cpu_is_read_from_proc_stat(tmp_path: Path) -> None:
    import os

    from run_lanes import machine_cpu

    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 20 30 400 50 1 2 3 7 0\ncpu0 50 10 15 200 25 0 1 1 0 0\n")
    tick = os.sysconf("SC_CLK_TCK")
    busy, idle = machine_cpu(stat)
    assert busy == (100 + 20 + 30 + 1 + 2 + 3) / tick and idle == (400 + 50) / tick
    real_busy, real_idle = machine_cpu()
    assert real_busy > 0 and real_idle >= 0
