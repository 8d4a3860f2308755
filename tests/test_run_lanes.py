"""The lanes of `make test` (tests/run_lanes.py): a test marked fault_lane is in a folder the faults
lane runs (elsewhere no lane would run it)."""

from __future__ import annotations

from pathlib import Path

from run_lanes import FAULT_DIRS

TESTS = Path(__file__).resolve().parent


def test_fault_lane_marks_only_tests_the_faults_lane_runs() -> None:
    marked = [p.relative_to(TESTS.parent).as_posix() for p in TESTS.rglob("test_*.py")
              if p.resolve() != Path(__file__).resolve() and "mark.fault_lane" in p.read_text()]
    assert marked, "no test is marked fault_lane: the check sees nothing"
    assert [m for m in marked if not m.startswith(FAULT_DIRS)] == []

