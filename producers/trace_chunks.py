"""A window's events as ``trace`` message bodies under a byte budget (packed int columns; higher tiers dropped first)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from rankscope.packed import narrowest_type, pack_int
from rankscope.producers.categories import (
    ANNOTATION,
    CATEGORIES,
)
from rankscope.producers.trace_columnar import EVENT_COLUMNS, TIER_OF_CATEGORY
from rankscope.protocol.trace_events import WIRE_INT_COLUMNS


def _tiers(col: dict[str, Any]) -> np.ndarray:
    ev = col["events"]
    cat = np.asarray(ev["category"], dtype=np.int64)
    tier = np.select([cat == c for c in TIER_OF_CATEGORY], list(TIER_OF_CATEGORY.values()), 1)
    ann = np.flatnonzero(cat == ANNOTATION)
    if len(ann):
        names = col["names"]
        name = np.asarray(ev["name"], dtype=np.int64)
        step_mark = np.fromiter((names[i].startswith("ProfilerStep#") for i in name[ann].tolist()), dtype=bool,
                                count=len(ann))
        tier[ann[step_mark]] = 0
    return tier


def _chunk_body(col: dict[str, Any], rows: np.ndarray, attrs_at: dict[int, Any]) -> dict[str, Any]:
    """A self-contained ``trace`` body for these rows (sorted by start): its own names, paths and
    tids tables, re-indexed; integer columns packed (rankscope/packed.py)."""
    ev = col["events"]
    names_all, paths_all = col["names"], col["paths"]
    name = np.asarray(ev["name"], dtype=np.int64)[rows]
    path = np.asarray(ev["path"], dtype=np.int64)[rows]
    # Paths used, closed under parents.
    used_paths: list[int] = []
    seen: set[int] = set()
    for p in np.unique(path[path >= 0]).tolist():
        while p >= 0 and p not in seen:
            seen.add(p)
            used_paths.append(p)
            p = paths_all[p][0]
    used_paths.sort()
    pmap = {p: i for i, p in enumerate(used_paths)}
    name_set = set(np.unique(name).tolist()) | {paths_all[p][1] for p in used_paths}
    used_names = sorted(name_set)
    nmap = np.full(len(names_all), -1, dtype=np.int64)
    nmap[used_names] = np.arange(len(used_names))
    nmap_l = nmap.tolist()
    new_paths = [[pmap[paths_all[p][0]] if paths_all[p][0] >= 0 else -1, nmap_l[paths_all[p][1]]]
                 for p in used_paths]
    tid = np.asarray(ev["tid"], dtype=np.int64)[rows]
    tids, tid_idx = np.unique(tid, return_inverse=True)
    start = np.asarray(ev["start_ns"], dtype=np.int64)[rows]
    t0 = int(start[0]) if len(start) else 0
    remap = np.full(len(paths_all) + 1, -1, dtype=np.int64)   # last slot: path -1 stays -1
    remap[used_paths] = np.arange(len(used_paths))
    columns = {"category": np.asarray(ev["category"])[rows], "name": nmap[name],
               "start_delta_ns": np.diff(start, prepend=t0), "tid": tid_idx.astype(np.int64), "path": remap[path]}
    types: dict[str, str] = {}
    events: dict[str, Any] = {}
    for c in WIRE_INT_COLUMNS:
        v = columns[c] if c in columns else np.asarray(ev[c], dtype=np.int64)[rows]
        types[c], events[c] = pack_int(v)
    if attrs_at:
        local = np.flatnonzero(np.isin(rows, np.fromiter(attrs_at, dtype=np.int64, count=len(attrs_at))))
        events["attrs"] = [[k, attrs_at[int(rows[k])]] for k in local.tolist()]
    else:
        events["attrs"] = []
    return {"window_id": col["window_id"], "t0_ns": t0, "count": len(rows),
            "categories": list(col.get("categories") or CATEGORIES), "names": [names_all[i] for i in used_names],
            "paths": new_paths, "tids": tids.tolist(), "column_types": types, "events": events}


_MAX_U32 = 2**32 - 1   # sizing placeholder for the chunk index and count


def _packed_len(body: Any) -> int:
    return len(msgpack.packb(body, use_bin_type=True))


def _split(col: dict[str, Any], rows: np.ndarray, sizes: np.ndarray, attrs_at: dict[int, Any],
           max_chunk_bytes: int, header: dict[str, Any], sizes_out: list[int]) -> list[dict[str, Any]]:
    """Cut ``rows`` (sorted by start) into bodies of at most ``max_chunk_bytes`` packed bytes
    (``header`` included; bodies are sized with the largest chunk index and count, which are set
    afterwards). Appends each body's packed size bound to ``sizes_out``."""
    if not len(rows):
        return []
    target = max(1, int(max_chunk_bytes * 0.85))
    cum = np.cumsum(sizes)
    cuts = np.searchsorted(cum, np.arange(target, int(cum[-1]) + target, target), side="right")
    cuts = np.unique(np.clip(np.concatenate([[0], cuts, [len(rows)]]), 0, len(rows)))
    out: list[dict[str, Any]] = []
    stack = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a][::-1]
    while stack:
        a, b = stack.pop()
        body = {**_chunk_body(col, rows[a:b], attrs_at), **header, "chunk": _MAX_U32, "chunks": _MAX_U32}
        size = _packed_len(body)
        if b - a > 1 and size > max_chunk_bytes:
            m = (a + b) // 2
            stack.extend([(m, b), (a, m)])
            continue
        sizes_out.append(size)
        out.append(body)
    return out


def chunk(col: dict[str, Any], byte_budget: int, max_chunk_bytes: int = 512_000
          ) -> tuple[list[dict[str, Any]], bool, int]:
    """Split a columnar window into ``trace`` message bodies. Returns (bodies, truncated, sent_events).

    Each body is self-contained (choice: tables in every chunk, restricted to what the chunk uses, so
    the sink converts any chunk alone, in any order, after a re-delivery or with a chunk lost)::

        {"window_id", "chunk": i, "chunks": n, "t0_ns": start of the chunk's first event, "count": events,
         "categories": [...], "names": [...], "paths": [[parent, name_idx], ...], "tids": [...],
         "column_types": {column: "i1"|"i2"|"i4"|"i8"},
         "events": {"category", "name", "start_delta_ns" (from the previous event; the first from t0_ns),
                    "dur_ns", "device", "stream", "step", "bytes", "corr", "tid" (index into tids),
                    "path" (index into paths or -1), "linked" (GPU work: its op's id):
                    little-endian packed ints (rankscope/packed.py),
                    "attrs": [[row, {...}], ...] for the rows that have attrs},
         "events_total", "events_sent", "truncated", "dropped": {category: events left out}}

    Events are in start order. ``byte_budget`` bounds the sum of the packed bodies. When the window
    does not fit, whole tiers are left out in this order: python, cpu_op, runtime, annotations
    (``ProfilerStep#N`` marks are kept), then kernels/memcpy/memset/collectives; within the tier that
    partly fits, the longest events are kept. Every body then says ``truncated: True`` with the
    per-category drop counts. No body is larger than ``max_chunk_bytes`` unless a single event is.
    """
    if byte_budget <= 0 or max_chunk_bytes <= 0:
        raise ValueError("byte_budget and max_chunk_bytes must be positive")
    ev = col["events"]
    n = len(ev["category"])
    if n == 0:
        return [], False, 0
    attrs = ev["attrs"]
    rows_with = col.get("attr_rows")
    if rows_with is None:
        rows_with = [i for i, a in enumerate(attrs) if a is not None]
    attrs_at = {i: attrs[i] for i in rows_with}
    start = np.asarray(ev["start_ns"], dtype=np.int64)
    # Packed bytes per event: each column at the window's narrowest type (a chunk's is no wider),
    # plus its attrs.
    width = sum(np.dtype(narrowest_type(np.asarray(ev[c], dtype=np.int64))).itemsize
                for c in EVENT_COLUMNS if c not in ("start_ns", "tid"))
    width += np.dtype(narrowest_type(np.diff(start))).itemsize + 2
    sizes = np.full(n, width, dtype=np.int64)
    if attrs_at:
        rows_a = np.fromiter(attrs_at, dtype=np.int64, count=len(attrs_at))
        sizes[rows_a] += np.array([_packed_len([0, a]) for a in attrs_at.values()], dtype=np.int64)
    cat = np.asarray(ev["category"], dtype=np.int64)

    first_step = int(col["first_step"])

    def build(rows: np.ndarray) -> tuple[list[dict[str, Any]], int]:
        kept = np.zeros(n, dtype=bool)
        kept[rows] = True
        dropped_counts = np.bincount(cat[~kept], minlength=len(CATEGORIES)).tolist()
        header = {"events_total": n, "events_sent": len(rows), "truncated": len(rows) < n,
                  "dropped": {CATEGORIES[c]: k for c, k in enumerate(dropped_counts) if k}, "first_step": first_step}
        packed: list[int] = []
        bodies = _split(col, rows, sizes[rows], attrs_at, max_chunk_bytes, header, packed)
        for i, body in enumerate(bodies):
            body["chunk"], body["chunks"] = i, len(bodies)
        return bodies, sum(packed)

    rows = np.arange(n)
    bodies, total = build(rows)
    if total > byte_budget:
        dur = np.asarray(ev["dur_ns"], dtype=np.int64)
        prio = np.lexsort((-dur, _tiers(col)))          # keep order: tier asc, then longest first
        cum_prio = np.cumsum(sizes[prio])
        # Shrink the estimated event budget until the packed bodies fit; tables and the larger start
        # deltas of a thinned window make the estimate low, so correct multiplicatively.
        event_budget = int(cum_prio[-1]) * byte_budget / total
        for _ in range(12):
            k = int(np.searchsorted(cum_prio, event_budget, side="right"))
            rows = np.sort(prio[:k])
            bodies, total = build(rows)
            if total <= byte_budget:
                break
            event_budget *= 0.97 * byte_budget / total
        else:
            rows, bodies = rows[:0], []
    sent = len(rows)
    return bodies, sent < n, sent
