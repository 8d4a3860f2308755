"""The trace-window bodies on the wire, one home for every runtime that writes or reads them.

- A ``trace`` chunk carries a window's events: integer columns (:data:`WIRE_INT_COLUMNS`, packed
  bytes typed by ``column_types`` as :mod:`rankscope.packed` writes them, or int lists), its own
  ``categories``, ``names``, ``paths`` ([parent, name] pairs: Python call paths) and ``tids``
  tables, ``t0_ns`` (start times are ``t0_ns`` plus the cumulative ``start_delta_ns``) and sparse
  ``attrs`` (``[[row, map], ...]``; a list of one map or nil per event in the list form). The ranks
  build chunks (producers/trace_chunks.py); :func:`chunk_columns` reads one as sent and
  :func:`decode_chunk` validates it whole and resolves it into rows (the sink stores those).
  The columns past :data:`REQUIRED_INT_COLUMNS` are optional (:data:`OPTIONAL_INT_COLUMNS`): a chunk
  without them, as ranks of earlier versions send, decodes with their defaults.
- Launch links: ``corr`` is the profiler's correlation id (0: none) of a runtime call and of the GPU
  work it launched, and an op's own id on other host events; ``linked`` is, on GPU work, the id of
  the op that launched it. :func:`decode_chunk` turns them into Kineto's two ids, ``correlation``
  (launch <-> GPU work) and ``external_id`` (op <-> launch), -1 where there is none.
- A ``summary`` body carries a rank's per-function table of the window and the window's bounds:
  :func:`summary_body` builds it, :func:`decode_summary` validates it for storage.

Decoding raises :class:`~rankscope.wire.WireError` (reason ``bad_body``) naming the bad field.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np

from rankscope.call_paths import expand_call_paths
from rankscope.packed import unpack_int_columns
from rankscope.wire import WireError

#: Integer columns of a trace chunk on the wire.
WIRE_INT_COLUMNS = ("category", "name", "start_delta_ns", "dur_ns", "device", "stream", "step", "bytes", "corr",
                    "tid", "path", "linked")
#: The columns a chunk must carry.
REQUIRED_INT_COLUMNS = ("category", "name", "start_delta_ns", "dur_ns", "device", "stream", "step", "bytes", "path")
#: Columns a chunk may leave out, and the value each event then has (``tid``: no entry of ``tids``).
OPTIONAL_INT_COLUMNS = {"corr": 0, "tid": -1, "linked": 0}
#: Integer columns of a summary's functions table.
SUMMARY_INT_COLUMNS = ("count", "total_ns", "median_ns", "p95_ns", "max_ns", "exclusive_ns")
I64 = (-(2 ** 63), 2 ** 63 - 1)
I32 = (-(2 ** 31), 2 ** 31 - 1)
_I32_COLUMNS = ("device", "stream")


def _bad(detail: str) -> WireError:
    return WireError("bad_body", detail)


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} is {type(value).__name__}, expected int")
    if not I64[0] <= value <= I64[1]:
        raise _bad(f"{name}={value} out of range {I64}")
    return value


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise _bad(f"{name} is {type(value).__name__}, expected str")
    return value


def _str_list(values: Any, name: str) -> list[str]:
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise _bad(f"{name} must be a list of strings")
    return values


def _int_list(values: Any, name: str, n: int) -> list[int]:
    if not isinstance(values, list) or len(values) != n:
        raise _bad(f"{name} must be a list of {n} values")
    if not all(type(v) is int for v in values):
        raise _bad(f"{name} holds a non-integer")
    if values and (min(values) < I64[0] or max(values) > I64[1]):
        raise _bad(f"{name} holds values out of range {I64}")
    return values


# Trace chunks --------------------------------------------------------------------------------------

def _int_columns(ev: dict[str, Any], types: Any) -> tuple[int, dict[str, np.ndarray]]:
    """The required columns and the optional ones present, as int64 arrays of one length; the
    optional ones absent filled with their defaults. Raises WireError naming a bad column."""
    present = tuple(c for c in OPTIONAL_INT_COLUMNS if c in ev)
    try:
        n, cols = unpack_int_columns(ev, types, REQUIRED_INT_COLUMNS + present)
    except ValueError as e:
        raise _bad(f"trace.events.{e}") from None
    for c, default in OPTIONAL_INT_COLUMNS.items():
        if c not in cols:
            cols[c] = np.full(n, default, dtype=np.int64)
    return n, cols


def chunk_columns(body: dict[str, Any]) -> dict[str, Any]:
    """The events of one ``trace`` body as sent: int64 arrays of :data:`WIRE_INT_COLUMNS` (the
    optional ones a chunk leaves out at their defaults) plus ``attrs`` (one dict or None per event).
    Raises WireError on a malformed body."""
    ev = body["events"]
    n, cols = _int_columns(ev, body.get("column_types"))
    attrs: list[Any] = [None] * n
    if "column_types" in body:
        for row, a in ev.get("attrs", []):
            attrs[row] = a
    else:
        attrs = list(ev.get("attrs", attrs))
    return {**cols, "attrs": attrs}


def _attr_map(a: Any, name: str) -> dict[str, str]:
    if a is None:
        return {}
    if not isinstance(a, dict):
        raise _bad(f"{name} is {type(a).__name__}, expected map or nil")
    return {str(k): v if isinstance(v, str) else json.dumps(v, separators=(",", ":")) for k, v in a.items()}


def _attrs(b: dict[str, Any], n: int) -> list[dict[str, str]]:
    attrs_in = b["events"].get("attrs", [])
    if not isinstance(attrs_in, list):
        raise _bad("trace.events.attrs must be a list")
    if "column_types" not in b:
        if len(attrs_in) != n:
            raise _bad(f"trace.events.attrs must be a list of {n} values")
        return [_attr_map(a, "trace.events.attrs[]") for a in attrs_in]
    out: list[dict[str, str]] = [{} for _ in range(n)]
    for item in attrs_in:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int and 0 <= item[0] < n):
            raise _bad("trace.events.attrs entries must be [row, map] with a row in the chunk")
        out[item[0]] = _attr_map(item[1], "trace.events.attrs[]")
    return out


def _resolved_paths(path_list: list[int], paths: list[Any], names: list[str]) -> dict[int, str]:
    """``root;...;leaf`` of each used call-path id, parents first, iteratively; a cycle is an error."""
    resolved: dict[int, str] = {}
    for pid in set(path_list) - {-1}:
        chain: list[int] = []
        p = pid
        while p >= 0 and p not in resolved:
            if p >= len(paths) or len(chain) > len(paths) or not 0 <= paths[p][1] < len(names):
                raise _bad(f"trace.paths entry {p} is malformed")
            chain.append(p)
            p = paths[p][0]
        prefix = resolved.get(p)
        for q in reversed(chain):
            leaf = names[paths[q][1]]
            prefix = leaf if prefix is None else f"{prefix};{leaf}"
            resolved[q] = prefix
    return resolved


def decode_chunk(body: dict[str, Any]) -> dict[str, Any]:
    """One ``trace`` body, validated whole, as rows: ``window_id``, ``n`` and per-event lists
    ``category`` and ``name`` (strings; Python events named by their call path ``root;...;leaf``),
    ``start_ns``, ``dur_ns``, ``device``, ``stream``, ``step``, ``bytes``, ``correlation`` and
    ``external_id`` (see :func:`launch_ids`) and ``attrs`` (string maps, non-string values as compact
    JSON). Raises WireError on any malformed part."""
    window_id = _str(body.get("window_id"), "trace.window_id")
    ev = body.get("events")
    if not isinstance(ev, dict):
        raise _bad("trace.events must be a map of columns")
    cats = _str_list(body.get("categories"), "trace.categories")
    names = _str_list(body.get("names"), "trace.names")
    paths = body.get("paths", [])
    if not isinstance(paths, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p) for p in paths):
        raise _bad("trace.paths must be a list of [parent, name] pairs")
    n, cols = _int_columns(ev, body.get("column_types"))
    if "count" in body and body["count"] != n:
        raise _bad(f"trace.count is {body['count']!r}, the columns hold {n} events")
    empty: dict[str, Any] = {"window_id": window_id, "n": 0}
    if not n:
        return empty
    for c in _I32_COLUMNS:
        if cols[c].min() < I32[0] or cols[c].max() > I32[1]:
            raise _bad(f"trace.events.{c} holds values out of range {I32}")
    attrs = _attrs(body, n)
    if cols["category"].min() < 0 or cols["category"].max() >= len(cats):
        raise _bad("trace.events.category outside the categories table")
    if cols["name"].min() < 0 or cols["name"].max() >= len(names):
        raise _bad("trace.events.name outside the names table")
    if cols["path"].min() < -1 or cols["path"].max() >= len(paths):
        raise _bad("trace.events.path outside the paths table")
    path_list = cols["path"].tolist()
    resolved = _resolved_paths(path_list, paths, names)
    t0 = _int(body.get("t0_ns"), "trace.t0_ns")
    deltas = cols["start_delta_ns"]
    if abs(t0) + max(abs(int(deltas.min())), abs(int(deltas.max()))) * n >= I64[1]:   # the cumulative sum could wrap
        starts = list(itertools.accumulate(deltas.tolist(), initial=t0))[1:]
        if min(starts) < I64[0] or max(starts) > I64[1]:
            raise _bad(f"trace.start_ns holds values out of range {I64}")
    else:
        starts = (t0 + np.cumsum(deltas)).tolist()
    category = [cats[c] for c in cols["category"].tolist()]
    correlation, external_id = launch_ids(np.array([c == "runtime" for c in category], dtype=bool),
                                          cols["device"], cols["corr"], cols["linked"])
    return {"window_id": window_id, "n": n, "category": category,
            "name": [resolved[p] if p >= 0 else names[i] for i, p in zip(cols["name"].tolist(), path_list, strict=True)],
            "start_ns": starts, "dur_ns": cols["dur_ns"].tolist(), "device": cols["device"].tolist(),
            "stream": cols["stream"].tolist(), "step": cols["step"].tolist(), "bytes": cols["bytes"].tolist(),
            "correlation": correlation.tolist(), "external_id": external_id.tolist(), "attrs": attrs}


def launch_ids(runtime: np.ndarray, device: np.ndarray, corr: np.ndarray, linked: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """Kineto's ``(correlation, external_id)`` of events from the wire's ``corr`` and ``linked``
    (int64 arrays; ``runtime``: bool, the event is a runtime call; ``device`` >= 0: GPU work):

    - GPU work: correlation = ``corr``, external id = ``linked`` (the launching op);
    - runtime calls: correlation = ``corr``, external id unknown;
    - other host events: external id = ``corr`` (the op's own id), no correlation.

    Ids <= 0 are none: -1."""
    gpu = device >= 0
    launch = gpu | runtime
    correlation = np.where(launch & (corr > 0), corr, -1)
    external_id = np.where(gpu, np.where(linked > 0, linked, -1), np.where(~launch & (corr > 0), corr, -1))
    return correlation.astype(np.int64), external_id.astype(np.int64)


# Summaries -----------------------------------------------------------------------------------------

def summary_body(col: dict[str, Any], functions: dict[str, Any], *, events_sent: int, truncated: bool,
                 status: str = "done") -> dict[str, Any]:
    """The body of a ``summary`` message for a window (``col``: its columnar events and bounds;
    ``functions``: its per-function table, producers/trace_summary.py ``summarize``)."""
    return {"window_id": col["window_id"], "functions": functions, "first_step": int(col["first_step"]),
            "last_step": int(col["last_step"]), "start_ns": int(col["start_ns"]), "end_ns": int(col["end_ns"]),
            "events_total": len(col["events"]["category"]), "events_sent": int(events_sent),
            "truncated": bool(truncated), "status": status}


def decode_summary(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(functions, window)`` of one ``summary`` body, validated: ``functions`` holds ``category``
    and ``name`` (call paths expanded to ``root;...;leaf``), :data:`SUMMARY_INT_COLUMNS`, ``n`` and
    ``window_ns``; ``window`` holds ``window_id``, ``status``, ``first_step``, ``last_step``,
    ``start_ns``, ``end_ns``, ``events`` (events sent: the rows the window should have) and
    ``truncated``. Raises WireError on any malformed part."""
    window_id = _str(body.get("window_id"), "summary.window_id")
    if not isinstance(body.get("functions"), dict):
        raise _bad("summary.functions must be a map of columns")
    try:
        f = expand_call_paths(body["functions"])
    except (TypeError, ValueError) as e:
        raise _bad(f"summary.functions: {e}") from None
    cats = _str_list(f.get("category"), "summary.functions.category")
    n = len(cats)
    fnames = _str_list(f.get("name"), "summary.functions.name")
    if len(fnames) != n:
        raise _bad(f"summary.functions.name has {len(fnames)} values, category has {n}")
    cols = {c: _int_list(f.get(c), f"summary.functions.{c}", n) for c in SUMMARY_INT_COLUMNS}
    start_ns = _int(body.get("start_ns"), "summary.start_ns")
    end_ns = _int(body.get("end_ns"), "summary.end_ns")
    window_ns = _int(f.get("window_ns", end_ns - start_ns), "summary.functions.window_ns")
    truncated = body.get("truncated", False)
    if not isinstance(truncated, bool):
        raise _bad(f"summary.truncated is {type(truncated).__name__}, expected bool")
    window = {"window_id": window_id, "status": _str(body.get("status", "done"), "summary.status"),
              "first_step": _int(body.get("first_step", -1), "summary.first_step"),
              "last_step": _int(body.get("last_step", -1), "summary.last_step"),
              "start_ns": start_ns, "end_ns": end_ns,
              "events": _int(body.get("events_sent", body.get("events_total", 0)), "summary.events_sent"),
              "truncated": truncated}
    return {"category": cats, "name": fnames, "n": n, "window_ns": window_ns, **cols}, window
