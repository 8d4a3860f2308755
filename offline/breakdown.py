"""GPU time breakdowns per rank, as pure functions over the events table of ``kineto.py``.

Every public function takes the events DataFrame (one or many ranks, ``rank`` column) and a
``hta_compatible`` switch, returns a new DataFrame in µs, and records the convention it used
in ``result.attrs["convention"]`` (``"hta"`` or ``"rankscope"``; see :func:`convention`).
Nothing here reads files, logs, or plots. The conventions and the events they keep live in
``conventions.py`` (re-exported here).

Two conventions:

* ``hta_compatible=True`` reproduces Holistic Trace Analysis 0.5 (``HTA_CONVENTION.rules``):
  the last ProfilerStep is dropped, GPU work without a recorded host launch is dropped,
  timestamps are rounded inward to whole µs, and kernels are classed by HTA's name rules.
* ``hta_compatible=False`` (default, ``RANKSCOPE_CONVENTION.rules``) keeps every step and every
  GPU event at ns precision and also recognises RCCL and other non-NCCL communication kernels.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from rankscope.offline.conventions import (
    ANALYZED_TYPES,
    COMMUNICATION,
    COMPUTATION,
    HTA_CONVENTION,
    MEMORY,
    NS_PER_US,
    OTHER,
    RANKSCOPE_CONVENTION,
    Convention,
    cached_views,
    classify_kernels,
    convention,
    gpu_work,
    hta_view,
)

__all__ = [
    "cached_views",
    "COMMUNICATION",
    "COMPUTATION",
    "HTA_CONVENTION",
    "MEMORY",
    "OTHER",
    "RANKSCOPE_CONVENTION",
    "Convention",
    "classify_kernels",
    "comm_comp_overlap",
    "convention",
    "gpu_work",
    "hta_view",
    "idle_time_breakdown",
    "kernel_breakdown_top",
    "kernel_type_breakdown",
    "temporal_breakdown",
]

# --------------------------------------------------------------------------- interval helpers


def _merge(ts: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals, HTA's way: sort by start; a new group starts when its start is after
    the running max of earlier ends; a group spans its min start to its max end."""
    if len(ts) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    order = np.argsort(ts, kind="stable")
    ts, end = ts[order], end[order]
    new = np.empty(len(ts), dtype=bool)
    new[0] = True
    new[1:] = ts[1:] > np.maximum.accumulate(end)[:-1]
    heads = np.flatnonzero(new)
    return ts[heads], np.maximum.reduceat(end, heads)


def _union_len(s: np.ndarray, e: np.ndarray) -> int:
    return int((e - s).sum())


def _sweep(sets: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Sweep over merged interval sets (HTA's way); set i adds 1<<i at a start and removes it at
    an end. Returns (running value, length) for each elementary segment with a positive running
    value. Inverted intervals (end < start, from inward rounding) are kept as HTA keeps them."""
    times, deltas = [], []
    for i, (s, e) in enumerate(sets):
        times += [s, e]
        deltas += [np.full(len(s), 1 << i, np.int64), np.full(len(e), -(1 << i), np.int64)]
    if not times:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    t = np.concatenate(times)
    d = np.concatenate(deltas)
    if len(t) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    order = np.argsort(t, kind="stable")
    t, d = t[order], d[order]
    running = np.cumsum(d)
    seg = np.diff(t)
    bits = running[:-1]
    keep = (bits > 0) & (seg > 0)
    return bits[keep], seg[keep]


def _ranks_of(df: pd.DataFrame) -> list[int]:
    return sorted(int(r) for r in pd.unique(df["rank"]))


def _by_rank(gpu: pd.DataFrame, ranks: list[int]) -> dict[int, pd.DataFrame]:
    groups = {int(r): g for r, g in gpu.groupby("rank", sort=True, observed=True)}
    return {r: groups.get(r, gpu.iloc[0:0]) for r in ranks}


def _finish(out: pd.DataFrame, hta_compatible: bool) -> pd.DataFrame:
    out.attrs["convention"] = convention(hta_compatible).name
    return out


# --------------------------------------------------------------------------- breakdowns


def temporal_breakdown(df: pd.DataFrame, hta_compatible: bool = False) -> pd.DataFrame:
    """Per rank: GPU idle, compute and non-compute time (µs) and their share of the GPU span.

    Steps per rank: kernel_time = end of the last merged GPU interval minus start of the first;
    idle = kernel_time minus the union of all GPU work; compute = union of COMPUTATION work;
    non-compute = kernel_time - compute - idle. Percentages are rounded to 2 decimals.

    Returns columns rank, idle_time(us), compute_time(us), non_compute_time(us), kernel_time(us),
    idle_time_pctg, compute_time_pctg, non_compute_time_pctg (HTA's temporal breakdown). A rank
    without GPU work gets zeros and NaN percentages.
    """
    gpu = gpu_work(df, hta_compatible)
    rows = []
    for rank, g in _by_rank(gpu, _ranks_of(df)).items():
        ts, end = g["ts_ns"].to_numpy(), g["end_ns"].to_numpy()
        s, e = _merge(ts, end)
        if len(s) == 0:
            rows.append((rank, 0, 0, 0, 0))
            continue
        kernel_time = int(e[-1] - s[0])
        idle = kernel_time - _union_len(s, e)
        comp = (g["kernel_type"] == COMPUTATION).to_numpy()
        cs, ce = _merge(ts[comp], end[comp])
        compute = _union_len(cs, ce)
        rows.append((rank, idle, compute, kernel_time - compute - idle, kernel_time))
    out = pd.DataFrame(rows, columns=["rank", "idle", "compute", "non_compute", "kernel"])
    res = pd.DataFrame({"rank": out["rank"].astype(int)})
    for col in ("idle", "compute", "non_compute", "kernel"):
        res[f"{col}_time(us)"] = out[col] / NS_PER_US
    span = out["kernel"].where(out["kernel"] > 0)
    for col in ("idle", "compute", "non_compute"):
        res[f"{col}_time_pctg"] = (100 * out[col] / span).round(2)
    return _finish(res, hta_compatible)


def comm_comp_overlap(df: pd.DataFrame, hta_compatible: bool = False) -> pd.DataFrame:
    """Per rank: share of communication time that overlaps computation.

    comp_comm_overlap_pctg = |union(comm) ∩ union(compute)| / |union(comm)| * 100, rounded to 2
    decimals (NaN without communication). Also returns comm_time(us) and overlap_time(us).
    """
    gpu = gpu_work(df, hta_compatible)
    rows = []
    for rank, g in _by_rank(gpu, _ranks_of(df)).items():
        ts, end = g["ts_ns"].to_numpy(), g["end_ns"].to_numpy()
        kt = g["kernel_type"].to_numpy()
        comm = _merge(ts[kt == COMMUNICATION], end[kt == COMMUNICATION])
        comp = _merge(ts[kt == COMPUTATION], end[kt == COMPUTATION])
        bits, seg = _sweep([comm, comp])
        overlap = int(seg[bits == 3].sum())
        comm_len = _union_len(*comm)
        rows.append((rank, overlap, comm_len))
    out = pd.DataFrame(rows, columns=["rank", "overlap", "comm"])
    res = pd.DataFrame({"rank": out["rank"].astype(int)})
    res["comp_comm_overlap_pctg"] = (100 * out["overlap"] / out["comm"].where(out["comm"] > 0)).round(2)
    res["comm_time(us)"] = out["comm"] / NS_PER_US
    res["overlap_time(us)"] = out["overlap"] / NS_PER_US
    return _finish(res, hta_compatible)


def _label(bits: int) -> str:
    return " overlapping ".join(t for i, t in enumerate(ANALYZED_TYPES) if bits & (1 << i))


def kernel_type_breakdown(df: pd.DataFrame, hta_compatible: bool = False, by_rank: bool = False) -> pd.DataFrame:
    """GPU time by kernel type, with overlaps as their own rows ("COMPUTATION overlapping
    COMMUNICATION"), like HTA's kernel type breakdown (memory kernels included).

    Steps per rank: merge each type's intervals; sweep them together; label each elementary segment
    by the set of active types. Sums are then added over ranks (``by_rank=False``, HTA's output)
    or kept per rank. Returns kernel_type, sum (µs), percentage (1 decimal) [, rank], sorted by sum.
    """
    gpu = gpu_work(df, hta_compatible)
    records: list[tuple[int, str, int]] = []
    for rank, g in _by_rank(gpu, _ranks_of(df)).items():
        ts, end = g["ts_ns"].to_numpy(), g["end_ns"].to_numpy()
        kt = g["kernel_type"].to_numpy()
        sets = [_merge(ts[kt == t], end[kt == t]) for t in ANALYZED_TYPES]
        bits, seg = _sweep(sets)
        if len(bits):
            sums = pd.Series(seg).groupby(bits).sum()
            records += [(rank, _label(int(b)), int(v)) for b, v in sums.items()]
    out = pd.DataFrame(records, columns=["rank", "kernel_type", "sum"])
    keys = ["rank", "kernel_type"] if by_rank else ["kernel_type"]
    out = out.groupby(keys, as_index=False)["sum"].sum()
    out["sum"] = out["sum"] / NS_PER_US
    total = out.groupby("rank")["sum"].transform("sum") if by_rank else out["sum"].sum()
    out["percentage"] = (100 * out["sum"] / total).round(1)
    order = ["rank", "sum"] if by_rank else ["sum"]
    out = out.sort_values(order, ascending=[True, False][-len(order):], kind="stable", ignore_index=True)
    cols = ["kernel_type", "sum", "percentage"] + (["rank"] if by_rank else [])
    return _finish(out[cols], hta_compatible)


def _aggregate_names(d: pd.DataFrame, k: int, duration_ratio: float) -> pd.DataFrame:
    stats = d.groupby("name", observed=True)["dur"].agg(["sum", "max", "min", "mean", "std"]).reset_index()
    stats = stats.sort_values("sum", ascending=False, kind="stable", ignore_index=True)
    stats["std"] = stats["std"].fillna(0.0)
    if len(stats) > k:
        cumsum = stats["sum"].cumsum()
        q = cumsum.quantile(duration_ratio)
        name = stats["name"].astype(object)
        name[(cumsum > q).to_numpy() | (stats.index >= k)] = "others"
        stats = pd.DataFrame({"name": name, "sum": stats["sum"]})
        stats = stats.groupby("name")["sum"].agg(["sum", "max", "min", "mean", "std"]).reset_index()
        stats["std"] = stats["std"].fillna(0.0)
    return stats


def kernel_breakdown_top(
    df: pd.DataFrame,
    k: int = 10,
    hta_compatible: bool = False,
    duration_ratio: float = 0.8,
    include_memory: bool = True,
) -> pd.DataFrame:
    """Top kernels per rank and kernel type, the rest folded into "others" (HTA's rule).

    Steps per rank and type: per kernel name, sum/max/min/mean/std of durations (µs); sorted by
    sum; if more than ``k`` names, a name whose running sum exceeds the ``duration_ratio``
    quantile of the running sums, or that ranks ``k``-th or later, becomes "others"; then rows are
    re-aggregated by name over their sums (so "others" max/min/mean/std describe per-name sums).

    Returns columns name, sum (us), max (us), min (us), stddev, mean (us), kernel_type, rank,
    sorted by kernel_type, name, rank.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not 0.0 < duration_ratio <= 1.0:
        raise ValueError(f"duration_ratio must be in (0, 1], got {duration_ratio}")
    gpu = gpu_work(df, hta_compatible)
    gpu["dur"] = gpu["dur_ns"] / NS_PER_US
    types = [COMPUTATION, COMMUNICATION] + ([MEMORY] if include_memory else [])
    parts = []
    for rank, g in _by_rank(gpu, _ranks_of(df)).items():
        for t in types:
            sub = g[g["kernel_type"] == t]
            if sub.empty:
                continue
            a = _aggregate_names(sub, k, duration_ratio)
            a["kernel_type"] = t
            a["rank"] = rank
            parts.append(a)
    cols = ["name", "sum (us)", "max (us)", "min (us)", "stddev", "mean (us)", "kernel_type", "rank"]
    if not parts:
        return _finish(pd.DataFrame(columns=cols), hta_compatible)
    out = pd.concat(parts, ignore_index=True)
    out["name"] = out["name"].astype(str)
    out = out.rename(columns={"sum": "sum (us)", "max": "max (us)", "min": "min (us)", "std": "stddev",
                              "mean": "mean (us)"})
    out = out.sort_values(["kernel_type", "name", "rank"], kind="stable", ignore_index=True)
    return _finish(out[cols], hta_compatible)


def idle_time_breakdown(
    df: pd.DataFrame,
    hta_compatible: bool = False,
    consecutive_kernel_delay_us: float = 30.0,
) -> pd.DataFrame:
    """Per rank and stream, GPU idle gaps between consecutive work split by cause (HTA's rule).

    Steps per stream: sort work by start; gap = start - end of the previous work; host_wait if the
    host launch (runtime event with the same correlation id) started after the previous work ended;
    else kernel_wait if the gap is shorter than ``consecutive_kernel_delay_us``; else other.

    Returns rank, stream, idle_category, idle_time(us), idle_time_ratio (2 decimals).
    """
    if consecutive_kernel_delay_us < 0:
        raise ValueError(f"consecutive_kernel_delay_us must be >= 0, got {consecutive_kernel_delay_us}")
    if hta_compatible:
        ev = hta_view(df)
        gpu = ev.loc[ev["stream"] != -1, ["rank", "stream", "ts_ns", "dur_ns", "correlation"]]
        gpu = gpu.assign(end_ns=gpu["ts_ns"] + gpu["dur_ns"])
        host = ev.loc[(ev["stream"] < 0) & (ev["correlation"] >= 0)]
    else:
        gpu = gpu_work(df, False)
        host = df.loc[(df["cat"].astype(str) == "runtime") & (df["correlation"] >= 0)]
    launch = host.drop_duplicates(["rank", "correlation"], keep="last").set_index(["rank", "correlation"])["ts_ns"]
    delay = consecutive_kernel_delay_us * NS_PER_US
    rows = []
    for (rank, stream), g in gpu.groupby(["rank", "stream"], sort=True, observed=True):
        g = g.sort_values("ts_ns", kind="stable")
        base = int(g["ts_ns"].iloc[0])  # relative times stay exact as float64 (absolute ns do not)
        ts = (g["ts_ns"].to_numpy() - base).astype(np.float64)
        prev_end = np.concatenate([[np.nan], (g["end_ns"].to_numpy()[:-1] - base).astype(np.float64)])
        gap = ts - prev_end
        idx = pd.MultiIndex.from_arrays([np.full(len(g), rank), g["correlation"].to_numpy()])
        ts_launch = (launch.reindex(idx) - base).to_numpy(dtype=np.float64)
        host_wait = ts_launch > prev_end
        kernel_wait = ~host_wait & (gap < delay)
        cat = np.where(host_wait, "host_wait", np.where(kernel_wait, "kernel_wait", "other"))
        sums = pd.Series(gap).groupby(cat).sum()
        total = sums.sum()
        for c, v in sums.items():
            rows.append((int(rank), int(stream), c, v / NS_PER_US, v / total if total else np.nan))
    out = pd.DataFrame(rows, columns=["rank", "stream", "idle_category", "idle_time(us)", "idle_time_ratio"])
    out = out.round({"idle_time(us)": 2, "idle_time_ratio": 2})
    return _finish(out, hta_compatible)
