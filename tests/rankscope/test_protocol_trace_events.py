"""The trace-window bodies' codec in the ground layer: what ranks build decodes to rows, and
malformed bodies raise WireError naming the field (the sink turns that into a dead letter)."""

from __future__ import annotations

import pytest

from rankscope.producers.trace_events import chunk, summarize, to_columnar
from rankscope.protocol.errors import WireError
from rankscope.protocol.trace_events import REQUIRED_INT_COLUMNS
from rankscope.protocol.trace_rows import chunk_columns, decode_chunk
from rankscope.protocol.trace_summary import decode_summary, summary_body

T0 = 1_700_000_000_000_000_000


def _window():
    events = [
        {"type": "user_annotation", "name": "ProfilerStep#7", "start_ns": T0, "dur_ns": 1000, "tid": 5},
        {"type": "python_function", "name": "train.py(3): main", "start_ns": T0 + 1, "dur_ns": 900, "tid": 5,
         "py_id": 1, "py_parent": -1},
        {"type": "cpu_op", "name": "aten::mm", "start_ns": T0 + 10, "dur_ns": 300, "tid": 5, "corr": 12},
    ]
    return to_columnar(events, "w-1", 7)


def test_chunks_decode_to_rows_and_summaries_round_trip():
    col = _window()
    bodies, truncated, sent = chunk(col, 1_000_000)
    rows = [decode_chunk(b) for b in bodies]
    assert sum(r["n"] for r in rows) == sent == 3 and not truncated
    got = sorted(zip(*(sum((r[c] for r in rows), []) for c in ("start_ns", "category", "name", "step")), strict=True))
    assert got == [(T0, "annotation", "ProfilerStep#7", 7), (T0 + 1, "python", "train.py(3): main", 7),
                   (T0 + 10, "cpu_op", "aten::mm", 7)]
    assert all(r["window_id"] == "w-1" for r in rows)
    functions, window = decode_summary(summary_body(col, summarize(col, compact_paths=True), events_sent=sent,
                                                    truncated=False))
    assert window == {"window_id": "w-1", "status": "done", "first_step": 7, "last_step": 7, "start_ns": T0,
                      "end_ns": T0 + 1000, "events": 3, "truncated": False, "thread_cpu_ns": -1,
                      "thread_runq_ns": -1}
    assert functions["n"] == len(functions["name"]) and "aten::mm" in functions["name"]
    assert functions["window_ns"] == 1000


def test_a_chunk_without_the_later_columns_still_decodes():
    (body,), _, _ = chunk(_window(), 1_000_000)
    cols = chunk_columns(body)
    old = {k: v for k, v in body.items() if k not in ("column_types", "count")}
    old["events"] = {**{c: cols[c].tolist() for c in REQUIRED_INT_COLUMNS}, "attrs": cols["attrs"]}   # no corr, tid, linked
    rows = decode_chunk(old)
    assert rows["name"] == decode_chunk(body)["name"]
    assert rows["correlation"] == rows["external_id"] == [-1, -1, -1]
    assert chunk_columns(old)["linked"].tolist() == [0, 0, 0] and chunk_columns(old)["tid"].tolist() == [-1, -1, -1]
    no_linked = {**body, "events": {k: v for k, v in body["events"].items() if k != "linked"}}
    assert decode_chunk(no_linked)["external_id"] == [-1, -1, 12]     # a rank that sends corr but not linked


def test_chunks_carry_kinetos_launch_links():
    events = [
        {"type": "cpu_op", "name": "aten::mm", "start_ns": T0, "dur_ns": 300, "tid": 5, "corr": 12},
        {"type": "cuda_runtime", "name": "cudaLaunchKernel", "start_ns": T0 + 10, "dur_ns": 20, "tid": 5, "corr": 700},
        {"type": "kernel", "name": "sgemm", "start_ns": T0 + 50, "dur_ns": 100, "device": 0, "stream": 7,
         "corr": 700, "linked": 12},
        {"type": "kernel", "name": "orphan", "start_ns": T0 + 200, "dur_ns": 10, "device": 0, "stream": 7},
    ]
    (body,), _, _ = chunk(to_columnar(events, "w-2", None), 1_000_000)
    assert "linked" in body["column_types"]
    rows = decode_chunk(body)
    got = {n: (c, e) for n, c, e in zip(rows["name"], rows["correlation"], rows["external_id"], strict=True)}
    assert got == {"aten::mm": (-1, 12), "cudaLaunchKernel": (700, -1), "sgemm": (700, 12), "orphan": (-1, -1)}
    bad = {**body, "events": {**body["events"], "linked": [1]}, "column_types": {**body["column_types"]}}
    del bad["column_types"]["linked"]
    with pytest.raises(WireError, match=r"trace\.events\.linked"):
        decode_chunk(bad)


@pytest.mark.parametrize("spoil, field", [
    ({"events": None}, "trace.events"),
    ({"window_id": 3}, "trace.window_id"),
    ({"categories": [1]}, "trace.categories"),
    ({"paths": [[0]]}, "trace.paths"),
    ({"t0_ns": "now"}, "trace.t0_ns"),
    ({"column_types": {}}, "trace.events.category"),
])
def test_malformed_chunks_raise_wire_errors_naming_the_field(spoil, field):
    (body,), _, _ = chunk(_window(), 1_000_000)
    with pytest.raises(WireError, match=field.replace(".", r"\.")) as e:
        decode_chunk({**body, **spoil})
    assert e.value.reason == "bad_body"


def test_malformed_summaries_raise_wire_errors():
    col = _window()
    good = summary_body(col, summarize(col, compact_paths=True), events_sent=3, truncated=False)
    for spoil in ({"functions": {"category": ["x"], "name": []}}, {"start_ns": 1.5}, {"truncated": "no"},
                  {"functions": None}):
        with pytest.raises(WireError, match="summary"):
            decode_summary({**good, **spoil})
