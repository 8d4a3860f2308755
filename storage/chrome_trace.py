"""Stored trace events -> a Chrome / Perfetto trace (JSON object format). Pure; the dashboard's
download and ``rankscope export`` write it.

The output opens in https://ui.perfetto.dev and chrome://tracing: one process per rank
(``pid`` = rank, named "rank N"), one thread per GPU stream or host thread, complete events
(``ph`` "X") with ``ts`` and ``dur`` in microseconds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import pandas as pd

#: Columns :func:`chrome_trace` reads (as returned by :func:`rankscope.storage.windows.trace_events`); ``attrs`` is optional.
EVENT_COLUMNS = ("rank", "category", "name", "start_ns", "dur_ns", "device", "stream", "step", "bytes")


def _tid(stream: int, attrs: Any) -> int:
    """GPU events sit on their stream; host events (stream < 0) on their thread id when recorded."""
    if stream >= 0:
        return int(stream)
    if isinstance(attrs, dict):
        try:
            return int(attrs.get("tid", stream))
        except (TypeError, ValueError):
            pass
    return int(stream)


def _us(ns: int) -> float:
    return round(ns / 1000.0, 3)


def chrome_trace(events: pd.DataFrame, origin_ns: int | None = None, job: str = "",
                 window_id: str = "") -> dict[str, Any]:
    """Build ``{"traceEvents": [...], ...}`` from trace events.

    ``ts`` is microseconds since ``origin_ns`` (default: the earliest event), which keeps nanosecond
    precision in a float; ``otherData.origin_ns`` holds the wall-clock origin. ``args`` carries
    step, device, stream, bytes (when > 0) and the event's attrs. Process and thread names are
    added as metadata events. Raises ValueError naming the missing columns.
    """
    missing = [c for c in EVENT_COLUMNS if c not in events.columns]
    if missing:
        raise ValueError(f"events lack columns {missing}; expected {list(EVENT_COLUMNS)}")
    if events.empty:
        return {"traceEvents": [], "displayTimeUnit": "ms",
                "otherData": {"job": job, "window_id": window_id, "origin_ns": origin_ns or 0}}
    origin = int(events["start_ns"].min()) if origin_ns is None else int(origin_ns)
    attrs: Iterable[Any] = events["attrs"] if "attrs" in events.columns else [None] * len(events)
    out: list[dict[str, Any]] = []
    threads: dict[tuple[int, int], str] = {}
    for rank, cat, name, start, dur, device, stream, step, nbytes, extra in zip(
            events["rank"], events["category"], events["name"], events["start_ns"], events["dur_ns"],
            events["device"], events["stream"], events["step"], events["bytes"], attrs, strict=True):
        rank, stream = int(rank), int(stream)
        tid = _tid(stream, extra)
        args: dict[str, Any] = {"step": int(step)}
        if int(device) >= 0:
            args["device"] = int(device)
        if stream >= 0:
            args["stream"] = stream
        if int(nbytes) > 0:
            args["bytes"] = int(nbytes)
        if isinstance(extra, dict):
            args.update({str(k): v for k, v in extra.items() if k != "tid"})
        out.append({"ph": "X", "name": str(name), "cat": str(cat), "ts": _us(int(start) - origin),
                    "dur": _us(max(0, int(dur))), "pid": rank, "tid": tid, "args": args})
        if (rank, tid) not in threads:
            threads[(rank, tid)] = f"stream {stream}" if stream >= 0 else (
                "host" if tid == stream else f"thread {tid}")
    meta: list[dict[str, Any]] = []
    for rank in sorted({r for r, _ in threads}):
        meta.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for (rank, tid), label in sorted(threads.items()):
        meta.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": label}})
    return {"traceEvents": meta + out, "displayTimeUnit": "ms",
            "otherData": {"job": job, "window_id": window_id, "origin_ns": origin}}


def chrome_trace_json(events: pd.DataFrame, **kwargs: Any) -> bytes:
    """:func:`chrome_trace` serialised compactly as UTF-8 JSON bytes (for a download)."""
    return json.dumps(chrome_trace(events, **kwargs), separators=(",", ":")).encode()
