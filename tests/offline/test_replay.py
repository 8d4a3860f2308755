"""Replay conversion: Kineto events table -> extract_events-style dicts -> the live window pipeline
(to_columnar / summarize / chunk), on the real traces in tests/data."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import numpy as np
import pytest

from rankscope.offline.kineto import load_trace, load_traces
from rankscope.offline.replay import (
    epoch_base_ns,
    event_dicts,
    event_types,
    skipped_count,
    time_offsets_ns,
)
from rankscope.producers.trace_events import CATEGORIES, chunk, summarize, summary_body, to_columnar
from rankscope.producers.trace_window import collective_arrivals
from rankscope.protocol.envelope import Envelope, decode, encode

DATA = Path(__file__).resolve().parents[1] / "data"
TYPES = {"kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cpu_op", "python_function", "user_annotation",
         "gpu_user_annotation"}


@pytest.fixture(scope="module")
def nccl_meta():
    return load_trace(DATA / "hta_nccl_meta_a100" / "nccl_data.json.gz", extra_columns=True)


@pytest.fixture(scope="module")
def resnet():
    return load_trace(DATA / "resnet_mi300_pyfn" / "resnet_act_checkpoint.json.gz", extra_columns=True)


def test_extra_columns_are_opt_in() -> None:
    path = DATA / "hta_sampled2" / "sampled_rank-0.json.gz"
    plain = load_trace(path).events
    extra = load_trace(path, extra_columns=True).events
    assert "py_id" not in plain.columns and "bytes" not in plain.columns
    assert list(extra.columns) == [*plain.columns, "py_id", "py_parent", "bytes"]
    mem = extra[extra["cat"].isin(["memcpy", "memset"])]
    assert (mem["bytes"] > 0).all()


def test_types_and_kernel_totals_match_the_trace(nccl_meta) -> None:
    ev = event_dicts(nccl_meta.events)
    df = nccl_meta.events
    assert {e["type"] for e in ev} <= TYPES
    assert skipped_count(df) == int((df["cat"] == "other").sum()) == 2   # two instant markers
    assert len(ev) == len(df) - 2
    counts = collections.Counter(e["type"] for e in ev)
    assert counts["kernel"] == int((df["cat"] == "kernel").sum())
    assert counts["cuda_runtime"] == int((df["cat"] == "runtime").sum())

    col = to_columnar(ev, "replay-0", None)
    fn = summarize(col)
    kernels = df[df["cat"] == "kernel"]
    nccl = kernels["name"].astype(str).str.startswith("nccl")
    # Non-NCCL kernels are "kernel", NCCL kernels "collective" on the device: count and total match.
    k = [i for i, c in enumerate(fn["category"]) if c == "kernel"]
    assert sum(fn["count"][i] for i in k) == int((~nccl).sum())
    assert sum(fn["total_ns"][i] for i in k) == int(kernels.loc[~nccl, "dur_ns"].sum())
    dev_coll = (col["events"]["category"] == CATEGORIES.index("collective")) & (col["events"]["device"] >= 0)
    assert int(dev_coll.sum()) == int(nccl.sum())
    assert int(col["events"]["dur_ns"][dev_coll].sum()) == int(kernels.loc[nccl, "dur_ns"].sum())
    # Steps from the ProfilerStep annotations, GPU work linked to its launch.
    assert (col["first_step"], col["last_step"]) == (4, 6)
    gpu = col["events"]["device"] >= 0
    assert (col["events"]["step"][gpu] >= 0).mean() > 0.99
    # Collective metadata survives under Kineto's keys and becomes the collective attrs.
    meta = [e["meta"] for e in ev if e.get("meta")]
    assert meta and all("Collective name" in m for m in meta)
    attrs = [a for a in col["events"]["attrs"] if a and a.get("op") == "allreduce" and "in_nelems" in a]
    assert attrs
    arrivals = collective_arrivals(col)
    assert len(arrivals["name"]) > 0


def test_python_stacks_become_call_paths(resnet) -> None:
    ev = event_dicts(resnet.events)
    py = [e for e in ev if e["type"] == "python_function"]
    assert len(py) == int((resnet.events["cat"] == "python").sum()) > 30_000
    assert all(e["py_id"] >= 0 for e in py)
    assert sum(e["py_parent"] < 0 for e in py) < len(py) / 100
    col = to_columnar(ev, "replay-0", None)
    fn = summarize(col)
    py_names = [n for c, n in zip(fn["category"], fn["name"], strict=True) if c == "python"]
    assert any(n.count(";") >= 5 for n in py_names)
    # AMD GPU events sit on their device (pid 2 in this trace).
    gpu_dev = {e["device"] for e in ev if e["type"] in ("kernel", "gpu_memcpy", "gpu_memset")}
    assert gpu_dev == {2}


def test_offsets_rebase_all_ranks_together() -> None:
    traces = load_traces(DATA / "hta_sampled2", extra_columns=True)
    assert all(epoch_base_ns(t.metadata) == 0 for t in traces.values())   # epoch µs in this set
    assert time_offsets_ns(traces) == {0: 0, 1: 0}
    now = time.time_ns()
    offs = time_offsets_ns(traces, now)
    assert offs[0] == offs[1] and offs[0] > 0
    ends = [int((t.events["ts_ns"] + t.events["dur_ns"]).max()) + offs[r] for r, t in traces.items()]
    assert max(ends) == now
    ev = event_dicts(traces[0].events, offset_ns=offs[0])
    assert max(e["start_ns"] + e["dur_ns"] for e in ev) <= now


def test_base_time_is_applied(nccl_meta) -> None:
    assert epoch_base_ns(nccl_meta.metadata) == 1711964646000000000
    ev = event_dicts(nccl_meta.events, offset_ns=epoch_base_ns(nccl_meta.metadata))
    start = min(e["start_ns"] for e in ev)
    assert 1.7e18 < start < 1.8e18   # 2024, on the epoch


def test_replayed_window_ships_like_a_live_one(nccl_meta) -> None:
    ev = event_dicts(nccl_meta.events, offset_ns=epoch_base_ns(nccl_meta.metadata))
    col = to_columnar(ev, "rp-0", None)
    bodies, truncated, sent = chunk(col, 50_000_000)
    assert not truncated and sent == len(ev)
    assert sum(b["count"] for b in bodies) == len(ev)
    body = summary_body(col, summarize(col), events_sent=sent, truncated=truncated, status="complete")
    body.update(request_id="rp", request_ranks=None, arrivals=collective_arrivals(col))
    for kind, b in [("trace", bodies[0]), ("summary", body)]:
        env = decode(encode(Envelope(kind=kind, job="j", rank=0, host="replay", pid=0, seq=1, sent_ns=1, body=b)))
        assert env.body["window_id"] == "rp-0"


def test_missing_columns_and_empty() -> None:
    with pytest.raises(ValueError, match="lacks columns"):
        import pandas as pd

        event_dicts(pd.DataFrame({"name": ["x"]}))
    assert len(event_types(load_trace(DATA / "hta_sampled2" / "sampled_rank-1.json.gz").events.iloc[:0])) == 0
    assert np.asarray(event_types(load_trace(DATA / "hta_sampled2" / "sampled_rank-1.json.gz").events)).dtype == object
