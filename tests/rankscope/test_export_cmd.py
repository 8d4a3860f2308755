"""``rankscope export``: a stored trace window -> Chrome trace JSON, against a real chDB store in tmp."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankscope.cli import main

pytestmark = pytest.mark.clickhouse

# Recent: trace_events expires rows 14 days after their start (TTL), even on insert.
T0 = (time.time_ns() // 10**9 - 3600) * 10**9


def _event(rank: int, category: str, name: str, start: int, dur: int, device: int = -1, stream: int = -1,
           step: int = 3, nbytes: int = 0, attrs: dict[str, str] | None = None, window: str = "tw1234-0",
           job: str = "jobA") -> dict:
    return {"job": job, "window_id": window, "rank": rank, "category": category, "name": name,
            "start_ns": T0 + start, "dur_ns": dur, "device": device, "stream": stream, "step": step,
            "bytes": nbytes, "attrs": attrs or {}}


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[str]:
    """A chDB store with one window of two ranks (plus another job's window); closed before the test
    runs the command, since chDB allows one open directory per process."""
    from rankscope.storage.store import close_store, open_store

    dsn = f"chdb://{tmp_path / 'ch'}"
    store = open_store(dsn)
    rows = [
        _event(0, "annotation", "ProfilerStep#3", 0, 10_000, attrs={"tid": "11"}),
        _event(0, "cpu_op", "aten::mm", 1_000, 2_000, attrs={"tid": "11"}),
        _event(0, "kernel", "sgemm", 3_500, 1_500, device=0, stream=7, attrs={"grid": "[1, 2, 3]"}),
        _event(0, "memcpy", "Memcpy HtoD", 5_000, 500, device=0, stream=7, nbytes=4096, attrs={"kind": "HtoD"}),
        _event(1, "collective", "ncclDevKernel_AllReduce", 2_000, 4_000, device=1, stream=20,
               attrs={"op": "allreduce"}),
        _event(1, "python", "train.py(10): step", 500, 9_000, attrs={"tid": "12"}),
        _event(0, "kernel", "other_job_kernel", 0, 10, device=0, stream=7, job="jobB"),
    ]
    store.insert("trace_events", rows)
    store.insert("trace_windows", [
        {"job": "jobA", "window_id": "tw1234-0", "rank": r, "status": "complete", "first_step": 3, "last_step": 3,
         "start_ns": T0, "end_ns": T0 + 10_000, "events": 4 if r == 0 else 2, "truncated": 0, "updated_ns": T0}
        for r in (0, 1)])
    close_store(dsn)
    try:
        yield dsn
    finally:
        close_store(dsn)


def test_export_writes_chrome_trace(stored: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "trace.json"
    rc = main(["export", "--clickhouse-dsn", stored, "--job", "jobA", "--window", "tw1234-0", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert "6 events from 2 ranks" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["otherData"]["job"] == "jobA" and doc["otherData"]["window_id"] == "tw1234-0"
    assert doc["otherData"]["origin_ns"] == T0
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in x) == sorted(["ProfilerStep#3", "aten::mm", "sgemm", "Memcpy HtoD",
                                                   "ncclDevKernel_AllReduce", "train.py(10): step"])
    by = {e["name"]: e for e in x}
    assert by["sgemm"]["pid"] == 1001 and by["sgemm"]["tid"] == 7 and by["sgemm"]["ts"] == 3.5
    assert by["sgemm"]["dur"] == 1.5 and by["sgemm"]["cat"] == "kernel"
    assert by["Memcpy HtoD"]["args"]["bytes"] == 4096
    assert by["aten::mm"]["pid"] == 1000 and by["aten::mm"]["tid"] == 11   # host events on their thread
    nccl = by["ncclDevKernel_AllReduce"]
    assert nccl["pid"] == 2002 and nccl["args"]["Collective name"] == "allreduce"
    names = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {(1000, "rank 0"), (1001, "rank 0 GPU 0"), (2000, "rank 1"), (2002, "rank 1 GPU 1")}
    assert not [e for e in doc["traceEvents"] if e["ph"] in ("s", "f")]   # rows stored without correlation ids


def test_export_by_request_prefix_and_ranks(stored: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r1.json"
    rc = main(["export", "--clickhouse-dsn", stored, "--job", "jobA", "--window", "tw1234", "--ranks", "1",
               "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in x} == {2000, 2002} and len(x) == 2
    assert doc["otherData"]["window_id"] == "tw1234-0" and doc["otherData"]["ranks"] == [1]


def test_export_unknown_window_and_bad_args(stored: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "none.json"
    rc = main(["export", "--clickhouse-dsn", stored, "--job", "jobA", "--window", "nope", "-o", str(out)])
    assert rc == 1 and not out.exists()
    assert "no stored trace events" in capsys.readouterr().err
    rc = main(["export", "--clickhouse-dsn", stored, "--job", "jobA", "--window", "tw1234-0", "--ranks", "x"])
    assert rc == 2 and "bad rank range" in capsys.readouterr().err
    rc = main(["export", "--clickhouse-dsn", stored, "--job", "jobA", "--window", "tw1234-0",
               "-o", str(tmp_path / "missing-dir" / "t.json")])
    assert rc == 2 and "cannot write" in capsys.readouterr().err


def test_export_store_locked_prints_hint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    import rankscope.storage.store as store_mod

    def locked(dsn: str, apply: bool = True) -> None:
        raise store_mod.StoreLocked(f"the embedded store {dsn} is open in another process (chDB allows one).")

    monkeypatch.setattr(store_mod, "open_store", locked)
    rc = main(["export", "--clickhouse-dsn", f"chdb://{tmp_path / 'ch'}", "--job", "j", "--window", "w"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "open in another process" in err
    assert "stop `rankscope serve`" in err and "Trace windows page" in err
