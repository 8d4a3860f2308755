"""Kineto trace files -> the event dicts a live trace window produces (``rankscope replay``). Pure.

:func:`event_dicts` turns one rank's events table (:func:`kineto.load_trace`, best with
``extra_columns=True`` so python call stacks and memcpy bytes survive) into the dicts that
``rankscope.producers.trace_events.extract_events`` returns, so a recorded trace goes through the same
``to_columnar`` / ``summarize`` / ``chunk`` path, processors and sink as a live window.

Mapping (reader column -> event dict key):

- ``type``: kernel, gpu_memcpy, gpu_memset, cuda_runtime (or the trace's own ``*_runtime`` /
  ``*_driver`` name), cpu_op, python_function, user_annotation, gpu_user_annotation. Host
  collectives keep their source type (``cpu_op`` or ``user_annotation``). Events of other kinds
  (instant events, unknown categories) are left out and counted by :func:`skipped_count`.
- ``start_ns`` = ``ts_ns + offset_ns``; ``dur_ns``.
- GPU events: ``device`` = the trace ``pid`` (Kineto writes the device index there), ``stream`` =
  ``args.stream``, else the ``tid``; ``corr`` = ``args.correlation``; ``linked`` = ``External id``
  (the launching op's id).
- Host events: ``tid``; ``corr`` = ``External id`` for ops and annotations, ``args.correlation``
  for runtime calls; python frames: ``py_id`` / ``py_parent`` (``Python id`` /
  ``Python parent id``) when the reader kept them.
- ``meta``: collective metadata under Kineto's own keys (``Collective name``, ``In msg nelems``,
  ``dtype``, ``Process Group Name`` ...); ``bytes`` for memcpy/memset when kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from rankscope.taxonomy import RUNTIME_TYPES

__all__ = ["RUNTIME_TYPES", "epoch_base_ns", "event_dicts", "event_types", "skipped_count", "time_offsets_ns"]

_GPU_TYPES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
# Reader's collective arg names (kineto._COLLECTIVE_ARG_KEYS) -> Kineto's own metadata keys.
_META_KEYS = {
    "collective": "Collective name",
    "in_msg_nelems": "In msg nelems",
    "out_msg_nelems": "Out msg nelems",
    "in_split_size": "In split size",
    "out_split_size": "Out split size",
    "dtype": "dtype",
    "group_size": "Group size",
    "pg_name": "Process Group Name",
    "pg_desc": "Process Group Description",
    "pg_ranks": "Process Group Ranks",
}


def _type_of(cat: str, raw: str) -> str | None:
    raw_l = raw.lower()
    if cat == "kernel":
        return "kernel"
    if cat == "memcpy":
        return "gpu_memcpy"
    if cat == "memset":
        return "gpu_memset"
    if cat == "runtime":
        return raw_l if raw_l in RUNTIME_TYPES else "cuda_runtime"
    if cat == "cpu_op":
        return "cpu_op"
    if cat == "python":
        return "python_function"
    if cat == "collective":
        return "user_annotation" if raw_l == "user_annotation" else "cpu_op"
    if cat == "annotation":
        return "gpu_user_annotation" if raw_l == "gpu_user_annotation" else "user_annotation"
    return None


def event_types(events: pd.DataFrame) -> np.ndarray:
    """The event-dict ``type`` of every row (object array), None for rows that are not replayed."""
    if events.empty:
        return np.empty(0, dtype=object)
    cats = events["cat"].astype(str).tolist()
    raws = events["raw_cat"].astype(str).tolist()
    lookup: dict[tuple[str, str], str | None] = {}
    out = np.empty(len(cats), dtype=object)
    for i, key in enumerate(zip(cats, raws, strict=True)):
        t = lookup.get(key, "")
        if t == "":
            t = lookup[key] = _type_of(*key)
        out[i] = t
    return out


def skipped_count(events: pd.DataFrame) -> int:
    """Rows :func:`event_dicts` leaves out (instant events, unknown categories)."""
    return int(sum(t is None for t in event_types(events)))


def _meta(args: Any) -> dict[str, Any] | None:
    if not isinstance(args, Mapping):
        return None
    out = {str(_META_KEYS.get(str(k), k)): v for k, v in args.items() if not str(k).endswith("_bytes")}
    return out or None


def event_dicts(events: pd.DataFrame, *, offset_ns: int = 0) -> list[dict[str, Any]]:
    """Event dicts (``rankscope.producers.trace_events`` format) of one rank's events table, in table order.

    ``offset_ns`` is added to every start (see :func:`time_offsets_ns`). Raises ValueError when
    the table lacks the reader's columns.
    """
    need = ("name", "cat", "raw_cat", "ts_ns", "dur_ns", "pid", "tid", "stream", "correlation", "external_id",
            "args")
    missing = [c for c in need if c not in events.columns]
    if missing:
        raise ValueError(f"events table lacks columns {missing}; load it with kineto.load_trace")
    types = event_types(events)
    n = len(events)
    has_py = "py_id" in events.columns and "py_parent" in events.columns
    py_id = events["py_id"].to_numpy() if has_py else np.full(n, -1, dtype=np.int64)
    py_parent = events["py_parent"].to_numpy() if has_py else np.full(n, -1, dtype=np.int64)
    nbytes = events["bytes"].to_numpy() if "bytes" in events.columns else np.zeros(n, dtype=np.int64)
    names = events["name"].astype(str).to_numpy(dtype=object)
    start = (events["ts_ns"].to_numpy(dtype=np.int64) + int(offset_ns)).tolist()
    dur = np.maximum(events["dur_ns"].to_numpy(dtype=np.int64), 0).tolist()
    pid = events["pid"].to_numpy(dtype=np.int64).tolist()
    tid = events["tid"].to_numpy(dtype=np.int64).tolist()
    stream = events["stream"].to_numpy(dtype=np.int64).tolist()
    corr = events["correlation"].to_numpy(dtype=np.int64).tolist()
    ext = events["external_id"].to_numpy(dtype=np.int64).tolist()
    args = events["args"].tolist()
    py_id_l, py_parent_l, bytes_l = py_id.tolist(), py_parent.tolist(), nbytes.tolist()
    out: list[dict[str, Any]] = []
    append = out.append
    for i, t in enumerate(types.tolist()):
        if t is None:
            continue
        rec: dict[str, Any] = {"type": t, "name": names[i], "start_ns": start[i], "dur_ns": dur[i]}
        if t == "python_function":
            rec["tid"] = tid[i]
            rec["py_id"] = py_id_l[i]
            rec["py_parent"] = py_parent_l[i]
            append(rec)
            continue
        if t in _GPU_TYPES:
            rec["device"] = pid[i] if pid[i] >= 0 else 0
            rec["stream"] = stream[i] if stream[i] >= 0 else tid[i]
            rec["corr"] = max(corr[i], 0)
            rec["linked"] = max(ext[i], 0)
        else:
            rec["tid"] = tid[i]
            c = corr[i] if t in RUNTIME_TYPES else ext[i]
            rec["corr"] = c if c >= 0 else max(corr[i], ext[i], 0)
        if bytes_l[i] > 0:
            rec["bytes"] = bytes_l[i]
        meta = _meta(args[i])
        if meta is not None:
            rec["meta"] = meta
        append(rec)
    return out


def epoch_base_ns(metadata: Mapping[str, Any]) -> int:
    """What to add to a trace's timestamps for Unix-epoch ns: ``baseTimeNanoseconds`` (recent Kineto
    writes timestamps relative to it), else 0 (older traces write epoch µs)."""
    base = metadata.get("baseTimeNanoseconds")
    return int(base) if isinstance(base, int) and not isinstance(base, bool) and base > 0 else 0


def time_offsets_ns(traces: Mapping[int, Any], now_ns: int | None = None) -> dict[int, int]:
    """Per-rank ``offset_ns`` for :func:`event_dicts`.

    Each rank's timestamps become epoch time (:func:`epoch_base_ns`). With ``now_ns`` all ranks are
    then shifted by one common amount so that the latest event ends at ``now_ns``: the relative
    timing of ranks is kept and the stored events are recent (the store expires old rows).
    """
    base = {r: epoch_base_ns(t.metadata) for r, t in traces.items()}
    if now_ns is None:
        return base
    ends = [int((t.events["ts_ns"] + t.events["dur_ns"]).max()) + base[r] for r, t in traces.items()
            if not t.events.empty]
    shift = int(now_ns) - max(ends) if ends else 0
    return {r: b + shift for r, b in base.items()}
