"""The on-rank summary of a window: per (category, name) count, total, median, p95, max and exclusive time."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from rankscope.call_paths import path_strings
from rankscope.producers.categories import (
    ANNOTATION,
    CATEGORIES,
    COLLECTIVE,
    CPU_OP,
    GPU_WORK,
    PYTHON,
)


def _cpu_self_time(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Self time of intervals on one thread: duration minus the parts of direct children inside it.

    ``start``/``end`` sorted by (start asc, end desc, parent-first tie break), all durations > 0. Depth of an
    interval = intervals open at its start; its parent = the latest earlier interval one level up.
    Exact for properly nested intervals; with improper overlaps a child counts only for its part
    inside the parent, and self time is clipped to [0, duration].
    """
    n = len(start)
    ords = np.arange(n)
    ended = np.searchsorted(np.sort(end), start, side="right")
    depth = ords - ended
    key = depth * n + ords
    # Sorting by depth (stable) sorts by key; small ints take numpy's radix sort.
    sk = np.argsort(depth.astype(np.int16) if depth.max(initial=0) < 2**15 else depth, kind="stable")
    skey = key[sk]
    want = (depth - 1) * n + ords
    pos = np.searchsorted(skey, want, side="left") - 1
    has = (depth > 0) & (pos >= 0)
    cand = np.where(has, sk[np.maximum(pos, 0)], -1)
    has &= (cand >= 0) & (depth[np.maximum(cand, 0)] == depth - 1)
    children: np.ndarray = np.zeros(n, dtype=np.float64)
    if has.any():
        c = np.flatnonzero(has)
        p = cand[c]
        contrib = np.clip(np.minimum(end[c], end[p]) - start[c], 0, None)
        children = np.bincount(p, weights=contrib.astype(np.float64), minlength=n)
    return np.clip(end - start - np.rint(children).astype(np.int64), 0, None)


def _sole_time(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per interval, the time during which it is the only one of ``start``/``end`` running."""
    n = len(start)
    t = np.concatenate([start, end])
    delta = np.concatenate([np.ones(n, np.int64), -np.ones(n, np.int64)])
    sign_id = np.concatenate([np.arange(n, dtype=np.int64), -np.arange(n, dtype=np.int64)])
    o = np.argsort(t, kind="stable")
    t, count, idsum = t[o], np.cumsum(delta[o]), np.cumsum(sign_id[o])
    seg = np.diff(t)
    alone = (count[:-1] == 1) & (seg > 0)
    return np.bincount(idsum[:-1][alone], weights=seg[alone].astype(np.float64), minlength=n).round().astype(np.int64)


def _uncovered_time(start: np.ndarray, end: np.ndarray, cov_start: np.ndarray, cov_end: np.ndarray) -> np.ndarray:
    """Per interval [start, end), the time not covered by the union of the cover intervals."""
    if not len(cov_start):
        return end - start
    m = len(cov_start)
    t = np.concatenate([cov_start, cov_end])
    delta = np.concatenate([np.ones(m, np.int64), -np.ones(m, np.int64)])
    o = np.argsort(t, kind="stable")
    t, count = t[o], np.cumsum(delta[o])
    busy_seg = np.where(count[:-1] > 0, np.diff(t), 0)
    busy_cum = np.concatenate([[0], np.cumsum(busy_seg)])   # busy time in [t0, t[k]]

    def busy_until(x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(t, x, side="right") - 1
        kk = np.clip(k, 0, len(t) - 1)
        tail = np.where((k >= 0) & (k < len(t) - 1) & (count[np.minimum(kk, len(count) - 1)] > 0), x - t[kk], 0)
        return np.where(k < 0, 0, busy_cum[kk] + tail)

    return np.clip((end - start) - (busy_until(end) - busy_until(start)), 0, None)


NATIVE_CODES = {"python": PYTHON, "collective": COLLECTIVE, "cpu_op": CPU_OP, "annotation": ANNOTATION,
                "gpu_work": list(GPU_WORK)}


def exclusive_times(col: dict[str, Any], native: Any = None) -> np.ndarray:
    """Exclusive ("not overlapped") ns of every event of a columnar window; see :func:`summarize`.
    ``native``: the C++ module (producers/native_extract.py), which computes the same."""
    ev = col["events"]
    cat = np.asarray(ev["category"], dtype=np.int64)
    start = np.asarray(ev["start_ns"], dtype=np.int64)
    dur = np.asarray(ev["dur_ns"], dtype=np.int64)
    dev = np.asarray(ev["device"], dtype=np.int64)
    tid = np.asarray(ev["tid"], dtype=np.int64)
    if native is not None:
        return native.exclusive_times(cat, start, dur, dev, tid, NATIVE_CODES)
    end = start + dur
    out = np.zeros(len(cat), dtype=np.int64)
    host = dev < 0
    is_ann = cat == ANNOTATION
    # Host: self time within each thread's nesting (annotations excluded from the forest).
    nest = host & ~is_ann & (dur > 0)
    prio = np.select([cat == PYTHON, cat == COLLECTIVE, cat == CPU_OP], [0, 1, 2], 3)
    presorted = bool(np.all((start[1:] > start[:-1]) | ((start[1:] == start[:-1]) & (end[1:] <= end[:-1]))))
    for t in np.unique(tid[nest]):
        idx = np.flatnonzero(nest & (tid == t))
        if presorted:       # columns come sorted by (start, -dur): only equal intervals need the tie break
            same = np.flatnonzero((start[idx][1:] == start[idx][:-1]) & (end[idx][1:] == end[idx][:-1]))
            if len(same):
                pos = np.unique(np.concatenate([same, same + 1]))
                sub = idx[pos]
                idx[pos] = sub[np.lexsort((prio[sub], -end[sub], start[sub]))]
        else:
            idx = idx[np.lexsort((prio[idx], -end[idx], start[idx]))]
        out[idx] = _cpu_self_time(start[idx], end[idx])
    for t in np.unique(tid[host & is_ann]):
        a = np.flatnonzero(host & is_ann & (tid == t))
        c = np.flatnonzero(nest & (tid == t))
        out[a] = _uncovered_time(start[a], end[a], start[c], end[c])
    # Device: time when no other GPU work runs on the same device.
    work = ~host & np.isin(cat, GPU_WORK)
    for d in np.unique(dev[~host]):
        w = np.flatnonzero(work & (dev == d))
        if len(w):
            out[w] = _sole_time(start[w], end[w])
        a = np.flatnonzero(~host & ~np.isin(cat, GPU_WORK) & (dev == d))
        if len(a):
            out[a] = _uncovered_time(start[a], end[a], start[w], end[w])
    return out


SUMMARY_COLUMNS = ("category", "name", "count", "total_ns", "median_ns", "p95_ns", "max_ns", "exclusive_ns")


def summarize(col: dict[str, Any], *, python_min_frac: float = 0.0, native: Any = None,
              compact_paths: bool = False) -> dict[str, Any]:
    """Per-function summary of a columnar window, grouped by (category, name); python events are
    grouped by call path and named ``"root;...;leaf"``.

    Returns columns (lists) ``category`` (str), ``name`` (str), ``count``, ``total_ns`` (sum of
    durations), ``median_ns``, ``p95_ns`` (linear interpolation, numpy's default), ``max_ns``,
    ``exclusive_ns``; plus scalars ``window_ns`` (window wall length, ``end_ns - start_ns``) and
    ``python_paths_dropped``.

    ``exclusive_ns`` = the sum over the group's events of the time each runs while no other useful
    work overlaps it:

    - host-side events (cpu_op, python, runtime, host collectives): self time in the nesting of the
      same thread: duration minus the time of direct children on that thread (python frames, ops,
      runtime calls, collectives; annotations are not part of the nesting);
    - host annotations (``ProfilerStep#N``, record_function ranges): time during which nothing else
      is recorded on the same thread;
    - GPU work (kernels, memcpy, memset, NCCL kernels): time during which no other GPU work runs on
      the same device (any stream); GPU annotations: time with no GPU work on the device.

    ``bottleneck ratio = exclusive_ns / window_ns``. Python call paths whose total is below
    ``python_min_frac * window_ns`` are left out (counted in ``python_paths_dropped``); the kept set is
    closed under prefixes (a parent path's total >= its children's).

    ``native``: the C++ module (producers/native_extract.py) for the exclusive times and the
    per-group statistics; the result is the same.

    ``compact_paths`` (the wire form of a ``summary`` body): python rows are named ``""`` and carry
    their call path in a ``"path"`` column (-1 for other rows), an index into ``"call_paths"``:
    ``{"names": [...], "paths": [[parent, name_idx], ...]}``, the table of the paths used, closed under
    parents. :func:`expand_call_paths` turns it back into the plain form. (A DDP window's summary:
    ~140 KB with every path spelt out, ~25 KB compact.)
    """
    ev = col["events"]
    cat = np.asarray(ev["category"], dtype=np.int64)
    name = np.asarray(ev["name"], dtype=np.int64)
    path = np.asarray(ev["path"], dtype=np.int64)
    dur = np.asarray(ev["dur_ns"], dtype=np.int64)
    window_ns = int(col["end_ns"]) - int(col["start_ns"])
    empty: dict[str, Any] = {c: [] for c in SUMMARY_COLUMNS}
    if not len(cat):
        return {**empty, "window_ns": window_ns, "python_paths_dropped": 0}
    excl = exclusive_times(col, native)
    by_path = (cat == PYTHON) & (path >= 0)           # python without a path (odd input): by name
    key = (cat << 41) + (by_path.astype(np.int64) << 40) + np.where(by_path, path, name)
    if native is not None:
        g_key, counts, total, median, p95, mx, excl_sum = native.group_stats(key, dur, excl)
    else:
        g_key, counts, total, median, p95, mx, excl_sum = group_stats(key, dur, excl)
    g_cat = g_key >> 41
    g_id = g_key & ((1 << 40) - 1)
    keep = np.ones(len(g_key), dtype=bool)
    is_py = ((g_key >> 40) & 1) == 1
    dropped = 0
    if python_min_frac > 0 and is_py.any():
        small = is_py & (total < python_min_frac * max(window_ns, 1))
        dropped = int(small.sum())
        keep &= ~small
    names = col["names"]
    cats = list(col.get("categories") or CATEGORIES)
    extra: dict[str, Any] = {}
    if compact_paths:
        py_ids = g_id[is_py & keep].tolist()
        table, remap = _used_paths(names, col["paths"], py_ids)
        fn_names = ["" if p else names[i] for p, i in zip(is_py[keep].tolist(), g_id[keep].tolist(), strict=True)]
        extra = {"path": [remap[i] if p else -1 for p, i in zip(is_py[keep].tolist(), g_id[keep].tolist(),
                                                                 strict=True)],
                 "call_paths": table}
    else:
        py_names = path_strings(names, col["paths"], g_id[is_py & keep].tolist())
        fn_names = [py_names[i] if p else names[i] for p, i in zip(is_py[keep].tolist(), g_id[keep].tolist(),
                                                                   strict=True)]
    return {
        "category": [cats[c] for c in g_cat[keep].tolist()],
        "name": fn_names,
        "count": counts[keep].tolist(), "total_ns": total[keep].tolist(), "median_ns": median[keep].tolist(),
        "p95_ns": p95[keep].tolist(), "max_ns": mx[keep].tolist(), "exclusive_ns": excl_sum[keep].tolist(),
        "window_ns": window_ns, "python_paths_dropped": dropped, **extra,
    }


def _used_paths(names: Sequence[str], paths: Sequence[Sequence[int]], ids: Iterable[int]
                ) -> tuple[dict[str, Any], dict[int, int]]:
    """The call-path table restricted to ``ids`` and their ancestors, re-indexed (parents keep lower
    ids), with its own names table; and old id -> new id."""
    used: set[int] = set()
    for p in ids:
        while p >= 0 and p not in used:
            used.add(p)
            p = paths[p][0]
    order = sorted(used)
    remap = {p: i for i, p in enumerate(order)}
    name_ids = sorted({paths[p][1] for p in order})
    nmap = {n: i for i, n in enumerate(name_ids)}
    table = [[remap[paths[p][0]] if paths[p][0] >= 0 else -1, nmap[paths[p][1]]] for p in order]
    return {"names": [names[i] for i in name_ids], "paths": table}, remap


def group_stats(key: np.ndarray, dur: np.ndarray, excl: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per distinct ``key`` (ascending): the key, count, total, median, p95 (linear interpolation,
    numpy's default) and max of ``dur``, and the sum of ``excl``."""
    o = np.lexsort((dur, key))
    k_s, d_s, x_s = key[o], dur[o], excl[o]
    first = np.concatenate([[True], k_s[1:] != k_s[:-1]])
    starts = np.flatnonzero(first)
    counts = np.diff(np.concatenate([starts, [len(k_s)]]))
    total = np.add.reduceat(d_s, starts)
    excl_sum = np.add.reduceat(x_s, starts)
    mx = d_s[starts + counts - 1]
    median = (d_s[starts + (counts - 1) // 2] + d_s[starts + counts // 2]) // 2
    pos = 0.95 * (counts - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.ceil(pos).astype(np.int64)
    vlo, vhi = d_s[starts + lo], d_s[starts + hi]
    p95 = np.rint(vlo + (vhi - vlo) * (pos - lo)).astype(np.int64)
    return k_s[starts], counts, total, median, p95, mx, excl_sum
