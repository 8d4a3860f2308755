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
