"""Stored trace events as a Chrome / Perfetto trace."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from rankscope.storage.chrome_trace import chrome_trace, chrome_trace_json


def _events() -> pd.DataFrame:
    return pd.DataFrame([
        {"rank": 1, "category": "python", "name": "main;step", "start_ns": 1_000_000_500, "dur_ns": 2_000,
         "device": -1, "stream": -1, "step": 4, "bytes": 0, "attrs": {"tid": "77"}},
        {"rank": 1, "category": "kernel", "name": "gemm", "start_ns": 1_000_001_000, "dur_ns": 1_500,
         "device": 0, "stream": 7, "step": 4, "bytes": 0, "attrs": {}},
        {"rank": 0, "category": "collective", "name": "ncclAllReduce", "start_ns": 1_000_000_000, "dur_ns": 10_000,
         "device": 0, "stream": 13, "step": 4, "bytes": 1024, "attrs": {"collective": "all_reduce"}},
        {"rank": 0, "category": "cpu_op", "name": "aten::mm", "start_ns": 1_000_000_100, "dur_ns": 100,
         "device": -1, "stream": -1, "step": 4, "bytes": 0, "attrs": None},
    ])


def test_chrome_trace_events():
    out = chrome_trace(_events(), job="j", window_id="w-0")
    assert out["otherData"] == {"job": "j", "window_id": "w-0", "origin_ns": 1_000_000_000}
    xs = [e for e in out["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 4
    py, gemm, nccl, mm = xs
    assert py == {"ph": "X", "name": "main;step", "cat": "python", "ts": 0.5, "dur": 2.0, "pid": 1, "tid": 77,
                  "args": {"step": 4}}
    assert (gemm["tid"], gemm["args"]["stream"], gemm["args"]["device"]) == (7, 7, 0)
    assert nccl["ts"] == 0.0 and nccl["dur"] == 10.0 and nccl["args"]["bytes"] == 1024
    assert nccl["args"]["collective"] == "all_reduce"
    assert mm["tid"] == -1 and mm["ts"] == 0.1
    meta = {(e["name"], e["pid"], e["tid"]): e["args"] for e in out["traceEvents"] if e["ph"] == "M"}
    assert meta[("process_name", 0, 0)] == {"name": "rank 0"}
    assert meta[("thread_name", 1, 7)] == {"name": "stream 7"}
    assert meta[("thread_name", 1, 77)] == {"name": "thread 77"}
    assert meta[("thread_name", 0, -1)] == {"name": "host"}
    assert json.loads(chrome_trace_json(_events()))["traceEvents"]


def test_chrome_trace_origin_empty_and_bad_input():
    out = chrome_trace(_events(), origin_ns=0)
    assert min(e["ts"] for e in out["traceEvents"] if e["ph"] == "X") == 1_000_000.0
    assert chrome_trace(_events().iloc[:0])["traceEvents"] == []
    with pytest.raises(ValueError, match="stream"):
        chrome_trace(_events().drop(columns=["stream"]))
