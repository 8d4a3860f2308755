"""One finished trace window -> compact columnar records, an on-rank summary, byte-budgeted chunks.

Pipeline (all on the rank, after the profiler stopped)::

    raw = extract_raw(prof)               # producers/trace_extract.py: KinetoEvents -> column lists
    col = to_columnar(raw, window_id, first_step)   # numpy columns, steps, python call paths
    functions = summarize(col)            # per (category, name): count, total, median, p95, max, exclusive
    bodies, truncated, sent = chunk(col, byte_budget)   # "trace" message bodies (packed int columns)
    summary = summary_body(col, functions, events_sent=sent, truncated=truncated)  # "summary" body

``to_columnar`` also takes a list of event dicts (the offline reader's output, tests); see
producers/trace_extract.py for the dict format and the clock, producers/categories.py for the
categories.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import numpy as np

from producers.categories import (  # noqa: F401  (re-exported: the category codes are part of this API)
    ANNOTATION,
    CAT,
    CATEGORIES,
    COLLECTIVE,
    CPU_OP,
    GPU_WORK,
    KERNEL,
    MEMCPY,
    MEMSET,
    PYTHON,
    RUNTIME,
)
from producers.trace_extract import (  # noqa: F401  (re-exported)
    RawEvents,
    detect_clock_offset_ns,
    experimental_config,
    extract_raw,
    frame_parents,
)
from rankscope.call_paths import expand_call_paths, path_strings  # noqa: F401  (re-exported)
from rankscope.packed import narrowest_type, pack_int

# Truncation tiers: when a window exceeds its byte budget, higher tiers go first.
# python -> cpu_op -> runtime -> annotations -> (kernels, memcpy/memset, collectives, ProfilerStep#N).
TIER_OF_CATEGORY = {PYTHON: 4, CPU_OP: 3, RUNTIME: 2, ANNOTATION: 1, KERNEL: 0, MEMCPY: 0, MEMSET: 0,
                    COLLECTIVE: 0}

EVENT_COLUMNS = ("category", "name", "start_ns", "dur_ns", "device", "stream", "step", "bytes", "corr", "tid",
                 "path")
# Integer columns of a trace chunk on the wire (packed, see rankscope/packed.py), plus sparse attrs.
WIRE_INT_COLUMNS = ("category", "name", "start_delta_ns", "dur_ns", "device", "stream", "step", "bytes", "corr",
                    "tid", "path")

STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")


# --------------------------------------------------------------------------------------------
# Columnar conversion
# --------------------------------------------------------------------------------------------

def _int_array(values: list[int], name: str) -> np.ndarray:
    try:
        return np.array(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"event column {name} holds a non-integer: {exc}") from None


def _call_paths(raw: RawEvents, py_names: np.ndarray, native: Any = None) -> tuple[np.ndarray, list[list[int]]]:
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
    ``stream`` (-1), ``step`` (-1 outside steps), ``bytes``, ``corr``, ``tid`` (system thread id, -1 on the
    device), ``path`` (python call-path id, -1 for other events): int64 numpy arrays sorted by start time;
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
    py_path, paths = _call_paths(raw, py_names, native)
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
              "step": step, "bytes": nbytes, "corr": corr, "tid": tid, "path": path}
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


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------

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
        g_key, counts, total, median, p95, mx, excl_sum = _group_stats(key, dur, excl)
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


def _group_stats(key: np.ndarray, dur: np.ndarray, excl: np.ndarray) -> tuple[np.ndarray, ...]:
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


def summary_body(col: dict[str, Any], functions: dict[str, Any], *, events_sent: int, truncated: bool,
                 status: str = "done") -> dict[str, Any]:
    """The body of a ``summary`` message for this window (what storage/sink.py maps to
    ``function_summaries`` rows and the ``trace_windows`` row)."""
    return {"window_id": col["window_id"], "functions": functions, "first_step": int(col["first_step"]),
            "last_step": int(col["last_step"]), "start_ns": int(col["start_ns"]), "end_ns": int(col["end_ns"]),
            "events_total": len(col["events"]["category"]), "events_sent": int(events_sent),
            "truncated": bool(truncated), "status": status}


# --------------------------------------------------------------------------------------------
# Chunking under a byte budget
# --------------------------------------------------------------------------------------------

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
                    "path" (index into paths or -1): little-endian packed ints (rankscope/packed.py),
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


def decode_chunk(body: dict[str, Any]) -> dict[str, Any]:
    """The events of one ``trace`` body as int64 arrays (``WIRE_INT_COLUMNS``) plus ``attrs`` (a list
    with one dict or None per event). Raises ValueError on a malformed body."""
    from rankscope.packed import unpack_int_columns

    ev = body["events"]
    n, cols = unpack_int_columns(ev, body.get("column_types"), WIRE_INT_COLUMNS)
    attrs: list[Any] = [None] * n
    if "column_types" in body:
        for row, a in ev.get("attrs", []):
            attrs[row] = a
    else:
        attrs = list(ev.get("attrs", attrs))
    return {**cols, "attrs": attrs}
