"""``rankscope export`` formats that go back in: from trace files (Kineto with flows, merged Chrome,
folded, speedscope) and a stored window's call paths (folded, speedscope), against a real chDB."""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankscope.cli import main
from rankscope.stream_processors.analysis.kineto import load_traces
from tests.stream_processors.analysis.trace_sets import DATA

T0 = (time.time_ns() // 10**9 - 3600) * 10**9


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[str]:
    from rankscope.storage.store import close_store, open_store

    dsn = f"chdb://{tmp_path / 'ch'}"
    store = open_store(dsn)
    rows = [{"job": "jobA", "window_id": "tw1-0", "rank": r, "category": c, "name": n, "count": 1, "total_ns": e,
             "median_ns": e, "p95_ns": e, "max_ns": e, "exclusive_ns": e, "window_ns": 10**9}
            for r, c, n, e in [(0, "python", "main;train", 2_000_000), (0, "python", "main;train;step", 5_000_000),
                               (1, "python", "main;train", 3_000_000), (0, "cpu_op", "aten::mm", 7_000_000)]]
    store.insert("function_summaries", rows)
    store.insert("trace_windows", [{"job": "jobA", "window_id": "tw1-0", "rank": r, "status": "complete",
                                    "first_step": 3, "last_step": 3, "start_ns": T0, "end_ns": T0 + 10_000,
                                    "events": 1, "truncated": 0, "updated_ns": T0} for r in (0, 1)])
    close_store(dsn)
    try:
        yield dsn
    finally:
        close_store(dsn)


@pytest.mark.clickhouse
def test_stored_window_as_folded_and_speedscope(stored: str, tmp_path: Path) -> None:
    out = tmp_path / "s.folded"
    assert main(["export", "--clickhouse-dsn", stored, "--job", "jobA", "--window", "tw1", "--format", "folded",
                 "-o", str(out)]) == 0
    assert out.read_text() == "rank_0;main;train 2000\nrank_0;main;train;step 5000\nrank_1;main;train 3000\n"
    sp = tmp_path / "p.json"
    assert main(["export", "--clickhouse-dsn", stored, "--job", "jobA", "--window", "tw1-0", "--format",
                 "speedscope", "-o", str(sp)]) == 0
    doc = json.loads(sp.read_text())
    assert [p["name"] for p in doc["profiles"]] == ["rank 0", "rank 1"]
    assert main(["export", "--clickhouse-dsn", stored, "--job", "jobA", "--window", "tw1-0", "--format",
                 "kineto"]) == 2                       # stored windows keep no correlation ids


def test_trace_files_as_kineto_chrome_folded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = DATA / "hta_sampled2"
    assert main(["export", "--traces", str(src), "--format", "kineto", "-o", str(tmp_path / "k")]) == 0
    files = sorted((tmp_path / "k").glob("rank-*.json.gz"))
    assert [f.name for f in files] == ["rank-0.json.gz", "rank-1.json.gz"]
    doc = json.loads(gzip.decompress(files[1].read_bytes()))
    assert doc["distributedInfo"]["rank"] == 1 and any(e["ph"] == "f" for e in doc["traceEvents"])
    assert sorted(load_traces(tmp_path / "k")) == [0, 1]
    assert main(["export", "--traces", str(src), "--format", "chrome", "-o", str(tmp_path / "m.json")]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    assert merged["otherData"]["ranks"] == [0, 1] and any(e["ph"] == "s" for e in merged["traceEvents"])
    py = DATA / "resnet_mi300_pyfn"
    assert main(["export", "--traces", str(py), "--format", "folded", "-o", str(tmp_path / "f")]) == 0
    lines = (tmp_path / "f").read_text().splitlines()
    assert lines and all(line.startswith("rank_0;") and int(line.rsplit(" ", 1)[1]) > 0 for line in lines)
    assert main(["export", "--format", "folded"]) == 2
    assert "--job and --window are required" in capsys.readouterr().err
