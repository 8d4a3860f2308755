"""``rankscope export`` formats that go back in: from trace files (Kineto with flows, merged Chrome,
folded, speedscope), a stored window's call paths (folded, speedscope) and a stored window's events
(Kineto per rank and merged Chrome, with flows), against a real chDB."""

from __future__ import annotations

import gzip
import json
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.offline_vs_hta import hta_python
from rankscope.cli import main
from rankscope.offline.kineto import load_traces
from tests.offline.test_exporters import HTA_SCRIPT
from tests.offline.trace_sets import DATA

T0 = (time.time_ns() // 10**9 - 3600) * 10**9


def stored_dsn(tmp_path: Path, fill: Callable[[Any], None]) -> Iterator[str]:
    """A chDB store filled by ``fill(store)`` and closed again, so that ``rankscope export`` opens it."""
    from rankscope.storage.store import close_store, open_store

    dsn = f"chdb://{tmp_path / 'ch'}"
    fill(open_store(dsn))
    close_store(dsn)
    try:
        yield dsn
    finally:
        close_store(dsn)


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[str]:
    yield from stored_dsn(tmp_path, fill_summaries)


def fill_summaries(store: Any) -> None:
    rows = [{"job": "jobA", "window_id": "tw1-0", "rank": r, "category": c, "name": n, "count": 1, "total_ns": e,
             "median_ns": e, "p95_ns": e, "max_ns": e, "exclusive_ns": e, "window_ns": 10**9}
            for r, c, n, e in [(0, "python", "main;train", 2_000_000), (0, "python", "main;train;step", 5_000_000),
                               (1, "python", "main;train", 3_000_000), (0, "cpu_op", "aten::mm", 7_000_000)]]
    store.insert("function_summaries", rows)
    store.insert("trace_windows", [{"job": "jobA", "window_id": "tw1-0", "rank": r, "status": "complete",
                                    "first_step": 3, "last_step": 3, "start_ns": T0, "end_ns": T0 + 10_000,
                                    "events": 1, "truncated": 0, "updated_ns": T0} for r in (0, 1)])


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


A100 = DATA / "hta_nccl_meta_a100"
TABLES = ("temporal_breakdown", "comm_comp_overlap", "kernel_type_breakdown", "idle_time_breakdown", "top_kernels")


@pytest.fixture
def stored_recording(tmp_path: Path) -> Iterator[str]:
    """A recorded A100 NCCL trace (cuda_runtime launches and kernels with correlation ids) stored as a
    live window is: the ranks' columnar code and chunks, the wire, the sink's row code, chDB."""
    from rankscope.cli.commands.replay import window_messages
    from rankscope.offline.kineto import load_trace
    from rankscope.offline.replay import epoch_base_ns, event_dicts
    from rankscope.protocol.envelope import Envelope, decode, encode
    from rankscope.storage.columns import TABLE_COLUMNS, Columns
    from rankscope.storage.rows import summary_columns, trace_columns

    t = load_trace(A100 / "nccl_data.json.gz", extra_columns=True)
    shift = T0 - int(t.events["ts_ns"].min()) // 1000 * 1000   # recent (the store expires old rows), whole µs
    bodies, summary = window_messages(event_dicts(t.events, offset_ns=epoch_base_ns(t.metadata) + shift),
                                      "rec1-0", 1 << 30)
    assert len(bodies) > 1 and not bodies[0]["truncated"]
    events, windows = Columns(TABLE_COLUMNS["trace_events"]), Columns(TABLE_COLUMNS["function_summaries"])
    for seq, (kind, body) in enumerate([*(("trace", b) for b in bodies), ("summary", summary)]):
        env = decode(encode(Envelope(kind=kind, job="jobR", rank=t.rank, host="h", pid=1, seq=seq, sent_ns=T0,
                                     body=body)))
        window = trace_columns(env, events) if kind == "trace" else summary_columns(env, windows)

    def fill(store: Any) -> None:
        store.insert_columns("trace_events", events.data)
        store.insert("trace_windows", [window])
    yield from stored_dsn(tmp_path, fill)


@pytest.mark.clickhouse
def test_stored_window_as_kineto_and_chrome_with_flows(stored_recording: str, tmp_path: Path) -> None:
    from rankscope.offline.analyze import analyze_paths
    from rankscope.offline.exporters import kineto_trace
    from rankscope.offline.kineto import load_trace

    assert main(["export", "--clickhouse-dsn", stored_recording, "--job", "jobR", "--window", "rec1",
                 "--format", "kineto", "-o", str(tmp_path / "k")]) == 0
    files = sorted((tmp_path / "k").glob("*.json.gz"))
    src = load_trace(A100 / "nccl_data.json.gz", extra_columns=True)
    assert [f.name for f in files] == [f"rank-{src.rank}.json.gz"]
    doc = json.loads(gzip.decompress(files[0].read_bytes()))
    assert doc["distributedInfo"] == {"rank": src.rank, "world_size": 1}

    def flows(d: dict) -> Counter[tuple[str, str]]:    # (launch, kernel) of every ac2g arrow
        by_ts = {}
        for e in d["traceEvents"]:
            if e["ph"] == "X":
                by_ts.setdefault((e["pid"], e["tid"], e["ts"]), e["name"])
        ends = {e["id"]: by_ts[(e["pid"], e["tid"], e["ts"])] for e in d["traceEvents"] if e["ph"] == "f"}
        return Counter((by_ts[(e["pid"], e["tid"], e["ts"])], ends[e["id"]]) for e in d["traceEvents"] if e["ph"] == "s")

    want = flows(kineto_trace(src.events, src.metadata, src.time_unit))
    got = flows(doc)
    assert got.total() > 1000 and got == want                    # the original's launch -> kernel arrows
    back = load_trace(files[0], extra_columns=True)
    kern = back.events[back.events["cat"] == "kernel"]
    assert (kern["correlation"] >= 0).all() and (kern["external_id"] >= 0).any()
    a = analyze_paths(A100, hta_compatible=True, workers=1, diagnose=False)
    b = analyze_paths(tmp_path / "k", hta_compatible=True, workers=1, diagnose=False)
    for key in TABLES:
        assert a[key] == b[key], key
    hta = subprocess.run([str(hta_python()), "-c", HTA_SCRIPT, str(A100), str(tmp_path / "k")], capture_output=True,
                         text=True, timeout=900)
    assert hta.returncode == 0, hta.stderr[-3000:]
    res = json.loads(next(line for line in hta.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert res[str(A100)] and res[str(tmp_path / "k")] == res[str(A100)]     # HTA itself reads it the same

    out = tmp_path / "m.json"
    assert main(["export", "--clickhouse-dsn", stored_recording, "--job", "jobR", "--window", "rec1-0",
                 "-o", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["otherData"]["window_id"] == "rec1-0" and merged["otherData"]["origin_ns"] > 0
    ids = [e["id"] for e in merged["traceEvents"] if e["ph"] == "s"]
    assert len(ids) == len(set(ids)) == sum(e["ph"] == "f" for e in merged["traceEvents"]) > 100


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
