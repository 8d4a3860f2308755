"""A finished trace window as numpy columns: one row per event, its step and its Python call path."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from rankscope.producers.categories import (
    ANNOTATION,
    CATEGORIES,
    COLLECTIVE,
    CPU_OP,
    KERNEL,
    MEMCPY,
    MEMSET,
    PYTHON,
    RUNTIME,
)
from rankscope.producers.trace_extract import RawEvents, frame_parents

# Truncation tiers: when a window exceeds its byte budget, higher tiers go first.
# python -> cpu_op -> runtime -> annotations -> (kernels, memcpy/memset, collectives, ProfilerStep#N).
TIER_OF_CATEGORY = {PYTHON: 4, CPU_OP: 3, RUNTIME: 2, ANNOTATION: 1, KERNEL: 0, MEMCPY: 0, MEMSET: 0,
                    COLLECTIVE: 0}

EVENT_COLUMNS = ("category", "name", "start_ns", "dur_ns", "device", "stream", "step", "bytes", "corr", "tid",
                 "path", "linked")

STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")


def _int_array(values: list[int], name: str) -> np.ndarray:
    try:
        return np.array(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"event column {name} holds a non-integer: {exc}") from None


def call_paths(raw: RawEvents, py_names: np.ndarray, native: Any = None) -> tuple[np.ndarray, list[list[int]]]:
    """Path id of every python frame and the interned path table ``[[parent, name], ...]``.

    A frame's parent is the frame whose ``py_id`` is its ``py_parent`` and is lower than its own id
    (the profiler numbers frames in call order; anything else is treated as a root, so garbage
    cannot make a cycle). Paths are interned level by level, so a parent's path id is below its
    children's. ``native``: the C++ module (producers/native_extract.py), which computes the same."""
    n = len(py_names)
    path = np.full(n, -1, dtype=np.int64)
    paths: list[list[int]] = []
    if not n:
        return path, paths
    ids = _int_array(raw.py["py_id"], "py_id")
    parents = _int_array(raw.py["py_parent"], "py_parent")
    if native is not None:
        path, t_parent, t_name = native.call_paths(ids, parents, py_names)
        return path, np.stack([t_parent, t_name], axis=1).tolist()
    parent = frame_parents(ids, parents)
    depth = np.zeros(n, dtype=np.int64)
    cur = parent
    while True:                 # ids strictly decrease up a chain: at most n rounds
        up = cur >= 0
        if not up.any():
            break
        depth += up
        cur = np.where(up, parent[np.maximum(cur, 0)], -1)
    width = int(py_names.max()) + 1
    for d in range(int(depth.max()) + 1):
        rows = np.flatnonzero(depth == d)
        p = parent[rows]
        pp = np.where(p >= 0, path[np.maximum(p, 0)], -1)
        keys, inv = np.unique((pp + 1) * width + py_names[rows], return_inverse=True)
        path[rows] = len(paths) + inv
        paths.extend([k // width - 1, k % width] for k in keys.tolist())
    return path, paths


def _sort_order(start: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """``np.lexsort((-dur, start))``, fast for nearly sorted starts: a stable argsort by start, then
    only the runs of equal starts re-sorted by duration."""
    order = np.argsort(start, kind="stable")
    s = start[order]
    tie = np.flatnonzero(s[1:] == s[:-1])
    if len(tie):
        pos = np.unique(np.concatenate([tie, tie + 1]))
        sub = order[pos]
        order[pos] = sub[np.lexsort((-dur[sub], start[sub]))]
    return order


def to_columnar(events: RawEvents | Sequence[dict[str, Any]], window_id: str, first_step: int | None,
                *, step_bounds: Sequence[tuple[int, int, int]] | None = None, native: Any = None) -> dict[str, Any]:
    """The events of one window (:class:`RawEvents`, or event dicts) -> one columnar window.

    Returns ``{"window_id", "first_step", "last_step", "start_ns", "end_ns", "categories", "names",
    "paths", "events"}`` where ``events`` holds equal-length columns: ``category`` (code into
    ``categories``), ``name`` (index into ``names``), ``start_ns``, ``dur_ns``, ``device`` (-1 on the host),
    ``stream`` (-1), ``step`` (-1 outside steps), ``bytes``, ``corr`` (correlation id; an op's own id on
    the host), ``tid`` (system thread id, -1 on the device), ``path`` (python call-path id, -1 for other
    events), ``linked`` (GPU work: the id of the op that launched it; 0 elsewhere): int64 numpy arrays
    sorted by start time;
    and ``attrs``: a list of small dicts or None (collectives: op/pg/group_size/dtype/in_nelems/...;
    memcpy: kind; kernels: grid/block when exposed).

    ``paths`` is the interned call-path table ``[[parent_path_id, name_idx], ...]`` (parent -1 at the
    root); a python event's name index is its own function, its path the chain up to the root.
    Python names lose object addresses (`` at 0x...``) so that paths intern across calls.

    Steps: ``step_bounds`` [(step, start_ns, end_ns), ...] if given (the tracer's own step records);
    else ``ProfilerStep#N`` annotations (present when the profiler has a schedule), numbered
    ``first_step + N - min(N)`` (or ``N`` when ``first_step`` is None). A host event gets the step whose
    interval contains its start; a GPU event gets the step of the CPU op that launched it
    (``linked``), else of its runtime call (same ``corr``), else by its own start time.
    Window bounds: the span of the steps if known, else of all events.

    ``native``: the C++ module (producers/native_extract.py) for the call paths, same result.

    Raises ValueError on event dicts without the required keys or with non-integer values.
    """
    raw = events if isinstance(events, RawEvents) else RawEvents.from_dicts(events)
    py, host, dv = raw.py, raw.host, raw.dev
    n_py, n_host, n_dev = len(py["name"]), len(host["name"]), len(dv["name"])
    n = n_py + n_host + n_dev
    names = raw.names

    def col(name: str, py_default: int | None, host_default: int | None, dev_default: int | None) -> np.ndarray:
        parts = []
        for group, size, default in ((py, n_py, py_default), (host, n_host, host_default), (dv, n_dev, dev_default)):
            if default is None:
                parts.append(_int_array(group[name], name))
            else:
                parts.append(np.full(size, default, dtype=np.int64))
        return np.concatenate(parts)

    py_names = _int_array(py["name"], "name")
    cat = np.concatenate([np.full(n_py, PYTHON, dtype=np.int64), _int_array(host["category"], "category"),
                          _int_array(dv["category"], "category")])
    name_ids = np.concatenate([py_names, _int_array(host["name"], "name"), _int_array(dv["name"], "name")])
    start = col("start_ns", None, None, None)
    if raw.offset_ns:
        start += raw.offset_ns
    dur = np.maximum(col("dur_ns", None, None, None), 0)
    dev = col("device", -1, -1, None)
    stream = col("stream", -1, -1, None)
    tid = col("tid", None, None, -1)
    corr = col("corr", 0, None, None)
    linked = col("linked", 0, 0, None)
    nbytes = col("bytes", 0, None, None)
    py_path, paths = call_paths(raw, py_names, native)
    path = np.concatenate([py_path, np.full(n_host + n_dev, -1, dtype=np.int64)])
    attrs_at: dict[int, Any] = {n_py + k: a for k, a in raw.host_attrs.items()}
    attrs_at.update((n_py + n_host + k, a) for k, a in raw.dev_attrs.items())

    # Steps.
    if step_bounds:
        sb = sorted(((int(s), int(a), int(b)) for s, a, b in step_bounds), key=lambda t: t[1])
        s_num = np.array([s for s, _, _ in sb], dtype=np.int64)
        s_start = np.array([a for _, a, _ in sb], dtype=np.int64)
        s_end = np.array([b for _, _, b in sb], dtype=np.int64)
    else:
        marks = [(int(m.group(1)), int(start[i]), int(start[i] + dur[i])) for i in np.flatnonzero(cat == ANNOTATION)
                 if (m := STEP_RE.match(names[name_ids[i]]))]
        marks.sort(key=lambda t: t[1])
        base = min((m[0] for m in marks), default=0)
        s_num = np.array([(first_step + k - base) if first_step is not None else k for k, _, _ in marks],
                         dtype=np.int64)
        s_start = np.array([a for _, a, _ in marks], dtype=np.int64)
        s_end = np.array([b for _, _, b in marks], dtype=np.int64)
    step = np.full(n, -1, dtype=np.int64)
    if len(s_num):
        k = np.searchsorted(s_start, start, side="right") - 1
        ok = (k >= 0) & (start < s_end[np.maximum(k, 0)])
        step[ok] = s_num[k[ok]]
        gpu = dev >= 0
        if gpu.any():
            host = ~gpu
            for key_gpu, host_mask in ((linked, host & (cat != RUNTIME)), (corr, host & (cat == RUNTIME))):
                hc = corr[host_mask]
                if not len(hc):
                    continue
                hs = step[host_mask]
                o = np.argsort(hc, kind="stable")
                hc, hs = hc[o], hs[o]
                want = gpu & (key_gpu > 0)
                pos = np.minimum(np.searchsorted(hc, key_gpu[want]), len(hc) - 1)
                hit = (hc[pos] == key_gpu[want]) & (hs[pos] >= 0)
                rows = np.flatnonzero(want)[hit]
                step[rows] = hs[pos[hit]]
                gpu = gpu.copy()
                gpu[rows] = False  # resolved; the runtime pass only fills the rest

    # Sort by start time, longest first on ties (stable: keeps the profiler's parent-before-child
    # order otherwise).
    order = _sort_order(start, dur)
    arrays = {"category": cat, "name": name_ids, "start_ns": start, "dur_ns": dur, "device": dev, "stream": stream,
              "step": step, "bytes": nbytes, "corr": corr, "tid": tid, "path": path, "linked": linked}
    cols: dict[str, Any] = {k: v[order] for k, v in arrays.items()}
    attrs: list[Any] = [None] * n
    attr_rows: list[int] = []
    if attrs_at:
        rank_of = np.empty(n, dtype=np.int64)
        rank_of[order] = np.arange(n)
        for i, a in attrs_at.items():
            r = int(rank_of[i])
            attrs[r] = a
            attr_rows.append(r)
        attr_rows.sort()
    cols["attrs"] = attrs

    if len(s_num):
        w_start, w_end = int(s_start.min()), int(s_end.max())
        first, last = int(s_num.min()), int(s_num.max())
    else:
        w_start = int(start.min()) if n else 0
        w_end = int((start + dur).max()) if n else 0
        first = first_step if first_step is not None else -1
        last = first
    return {"window_id": window_id, "first_step": first, "last_step": last, "start_ns": w_start, "end_ns": w_end,
            "categories": list(CATEGORIES), "names": names, "paths": paths, "events": cols, "attr_rows": attr_rows}
