"""A ``trace`` chunk's events (rankscope/protocol/trace_events.py) read and validated into rows.

:func:`chunk_columns` reads a chunk as sent; :func:`decode_chunk` validates it whole and resolves it
into rows (the sink stores those), with the launch links turned into Kineto's two ids by
:func:`launch_ids`: ``correlation`` (launch <-> GPU work) and ``external_id`` (op <-> launch), -1
where there is none.

Decoding raises :class:`~rankscope.protocol.errors.WireError` (reason ``bad_body``) naming the bad field.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np

from rankscope.packed import unpack_int_columns
from rankscope.protocol.errors import bad_body
from rankscope.protocol.fields import I32, I64, int_field, str_field, str_list
from rankscope.protocol.trace_events import I32_COLUMNS, OPTIONAL_INT_COLUMNS, REQUIRED_INT_COLUMNS


def _int_columns(ev: dict[str, Any], types: Any) -> tuple[int, dict[str, np.ndarray]]:
    """The required columns and the optional ones present, as int64 arrays of one length; the
    optional ones absent filled with their defaults. Raises WireError naming a bad column."""
    present = tuple(c for c in OPTIONAL_INT_COLUMNS if c in ev)
    try:
        n, cols = unpack_int_columns(ev, types, REQUIRED_INT_COLUMNS + present)
    except ValueError as e:
        raise bad_body(f"trace.events.{e}") from None
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
        raise bad_body(f"{name} is {type(a).__name__}, expected map or nil")
    return {str(k): v if isinstance(v, str) else json.dumps(v, separators=(",", ":")) for k, v in a.items()}


def _attrs(b: dict[str, Any], n: int) -> list[dict[str, str]]:
    attrs_in = b["events"].get("attrs", [])
    if not isinstance(attrs_in, list):
        raise bad_body("trace.events.attrs must be a list")
    if "column_types" not in b:
        if len(attrs_in) != n:
            raise bad_body(f"trace.events.attrs must be a list of {n} values")
        return [_attr_map(a, "trace.events.attrs[]") for a in attrs_in]
    out: list[dict[str, str]] = [{} for _ in range(n)]
    for item in attrs_in:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int and 0 <= item[0] < n):
            raise bad_body("trace.events.attrs entries must be [row, map] with a row in the chunk")
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
                raise bad_body(f"trace.paths entry {p} is malformed")
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
    window_id = str_field(body.get("window_id"), "trace.window_id")
    ev = body.get("events")
    if not isinstance(ev, dict):
        raise bad_body("trace.events must be a map of columns")
    cats = str_list(body.get("categories"), "trace.categories")
    names = str_list(body.get("names"), "trace.names")
    paths = body.get("paths", [])
    if not isinstance(paths, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p) for p in paths):
        raise bad_body("trace.paths must be a list of [parent, name] pairs")
    n, cols = _int_columns(ev, body.get("column_types"))
    if "count" in body and body["count"] != n:
        raise bad_body(f"trace.count is {body['count']!r}, the columns hold {n} events")
    empty: dict[str, Any] = {"window_id": window_id, "n": 0}
    if not n:
        return empty
    for c in I32_COLUMNS:
        if cols[c].min() < I32[0] or cols[c].max() > I32[1]:
            raise bad_body(f"trace.events.{c} holds values out of range {I32}")
    attrs = _attrs(body, n)
    if cols["category"].min() < 0 or cols["category"].max() >= len(cats):
        raise bad_body("trace.events.category outside the categories table")
    if cols["name"].min() < 0 or cols["name"].max() >= len(names):
        raise bad_body("trace.events.name outside the names table")
    if cols["path"].min() < -1 or cols["path"].max() >= len(paths):
        raise bad_body("trace.events.path outside the paths table")
    path_list = cols["path"].tolist()
    resolved = _resolved_paths(path_list, paths, names)
    t0 = int_field(body.get("t0_ns"), "trace.t0_ns")
    deltas = cols["start_delta_ns"]
    if abs(t0) + max(abs(int(deltas.min())), abs(int(deltas.max()))) * n >= I64[1]:   # the cumulative sum could wrap
        starts = list(itertools.accumulate(deltas.tolist(), initial=t0))[1:]
        if min(starts) < I64[0] or max(starts) > I64[1]:
            raise bad_body(f"trace.start_ns holds values out of range {I64}")
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


