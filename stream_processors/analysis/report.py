"""Function-level diagnosis of one trace window across workers (PerfTracker-style report).

Input: the on-rank summaries of one window, as a DataFrame with columns
``rank, category, name, count, total_ns, exclusive_ns, median_ns, max_ns, window_ns`` (one row per
rank and function; ``exclusive_ns`` = time the function runs while nothing else useful overlaps
it; see producers/trace_events.py), and optionally collective arrivals
``rank, name, seq, start_ns`` (the k-th call of each collective on each rank).

Definitions (README "Diagnosis metrics"):
- bottleneck ratio of a function on a worker = exclusive_ns / window_ns;
- abnormal = robust z-score against the other workers (``outliers.peer_z``: their median and
  MAD x 1.4826, scale floored at 5% of that median) above ``z_threshold``, and, for memory ops, CUDA runtime and Python functions,
  PerfTracker's floor: the value is at least 1% of the window;
- busy time of a worker = exclusive time of kernels, memory ops, runtime calls and CPU ops (not
  collectives, annotations or Python self time, which is mostly waiting), each function's calls
  taken at their median cost (one call stretched by preemption is not slowness); slow
  workers have abnormal busy time, less any wait for a CPU beyond the other ranks' (where the ranks
  sent their training thread's run-queue wait: see ``slow_workers``); the cost of a slow worker's function = its excess over the
  median of the other workers x world size (every rank waits for it), in rank-seconds.
Everything here is pure: DataFrames in, a JSON-able dict out.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from rankscope.own_frames import has_own_frame
from rankscope.stream_processors.analysis.outliers import flag_slow, peer_z
from rankscope.stream_processors.cpu_wait import starved

GPU_CATS = ("kernel",)
MEM_CATS = ("memcpy", "memset")
COMPUTE_CATS = ("kernel", "cpu_op", "python", "memcpy", "memset", "runtime")
BUSY_CATS = ("kernel", "cpu_op", "memcpy", "memset", "runtime")   # python self time is mostly waiting
HOST_BUSY_CATS = ("cpu_op", "runtime")   # the busy time of the training thread (the rest is the device's)
THREAD_ROOT = "_bootstrap"  # threading.py(...): _bootstrap: the root frame of every non-main Python thread
FLOOR = 0.01


def _per_rank(df: pd.DataFrame, cats: tuple[str, ...], col: str, ranks: list[int]) -> pd.Series:
    sub = df[df["category"].isin(cats)]
    return sub.groupby("rank")[col].sum().reindex(ranks, fill_value=0).astype(float)


def _abnormal(series: pd.Series, window: pd.Series, z_threshold: float, floor: float | None,
              both_sides: bool = False) -> list[dict[str, Any]]:
    if len(series) < 3:
        return []
    pz = peer_z({int(r): float(v) for r, v in series.items()})
    out = []
    for r, v in series.items():
        z = pz[int(r)].z
        hit = z > z_threshold or (both_sides and z < -z_threshold)
        if hit and (floor is None or v >= floor * float(window[r])):
            out.append({"rank": int(r), "value_ms": round(v / 1e6, 3), "median_ms": round(pz[int(r)].baseline / 1e6, 3),
                        "z": round(float(z), 2)})
    return out


def build_report(summaries: pd.DataFrame, arrivals: pd.DataFrame | None = None, *, job: str = "",
                 window_id: str = "", world_size: int | None = None, z_threshold: float = 4.0,
                 min_rel_excess: float = 0.25, expected_ranks: list[int] | None = None) -> dict[str, Any]:
    """Build the report dict for one window. Raises ValueError on missing columns or no rows."""
    need = {"rank", "category", "name", "count", "total_ns", "exclusive_ns", "window_ns"}
    missing = need - set(summaries.columns)
    if missing:
        raise ValueError(f"summaries lack columns {sorted(missing)}")
    if summaries.empty:
        raise ValueError("no summaries for this window")
    df = without_own_frames(summaries)
    ranks = sorted(int(r) for r in df["rank"].unique())
    world = world_size or len(ranks)
    window = df.groupby("rank")["window_ns"].max().reindex(ranks).astype(float)
    cats = set(df["category"].unique())
    report: dict[str, Any] = {
        "job": job, "window_id": window_id, "ranks": ranks, "world_size": world,
        "missing_ranks": sorted(set(expected_ranks or []) - set(ranks)),
        "window_ms": {str(r): round(float(window[r]) / 1e6, 3) for r in ranks},
        "definitions": {"bottleneck_ratio": "exclusive time / window length",
                        "abnormal": f"robust z-score against the other workers > {z_threshold} (memory ops, CUDA runtime, "
                                    f"Python functions also need >= {FLOOR:.0%} of the window)"},
        "not_applicable": [],
    }
    # GPU compute ----------------------------------------------------------------------------
    if cats & set(GPU_CATS):
        busy = _per_rank(df, GPU_CATS, "exclusive_ns", ranks)
        util = (_per_rank(df, GPU_CATS, "total_ns", ranks) / window).clip(upper=1.0)
        kern = df[df["category"] == "kernel"]
        major = (kern.groupby("name").agg(total=("total_ns", "median"), excl=("exclusive_ns", "median"),
                                          calls=("count", "median"))
                 .sort_values("total", ascending=False).head(10))
        per_call = kern.assign(per_call=kern["total_ns"] / kern["count"].clip(lower=1))
        problems = []
        for name, g in per_call.groupby("name"):
            s = g.set_index("rank")["per_call"]
            for hit in _abnormal(s, window, z_threshold, None):
                problems.append({**hit, "kernel": name})
        report["gpu_compute"] = {
            "utilisation": {"min": round(float(util.min()), 4), "median": round(float(util.median()), 4),
                            "max": round(float(util.max()), 4)},
            "abnormal_utilisation": [{"rank": h["rank"], "z": h["z"]} for h in
                                     _abnormal(-util * 1e6, window, z_threshold, None)],
            "major_kernels": [{"name": n, "median_cost_per_call_us": round(r.total / max(r.calls, 1) / 1e3, 3),
                               "bottleneck_ratio": round(r.excl / float(window.median()), 4)}
                              for n, r in major.iterrows()],
            "workers_with_potential_gpu_problems": problems,
            "busy_ms": {str(r): round(float(v) / 1e6, 3) for r, v in busy.items()},
        }
    else:
        report["not_applicable"].append("gpu_compute: no GPU kernels in this window (CPU-only job)")
    # GPU memory operations ----------------------------------------------------------------------
    if cats & set(MEM_CATS):
        mem = _per_rank(df, MEM_CATS, "exclusive_ns", ranks)
        report["gpu_memory_operations"] = {
            "average_bottleneck_ratio": round(float((mem / window).mean()), 4),
            "abnormal_workers": _abnormal(mem, window, z_threshold, FLOOR)}
    else:
        report["not_applicable"].append("gpu_memory_operations: no memcpy/memset in this window")
    # Communication ---------------------------------------------------------------------------
    coll = df[df["category"] == "collective"]
    if not coll.empty:
        by = []
        for name, g in coll.groupby("name"):
            s = g.set_index("rank")["total_ns"].reindex(ranks, fill_value=0).astype(float)
            normal = int((s - s.median()).abs().idxmin())
            row = g.set_index("rank").reindex(ranks)
            nbytes = row["bytes"].fillna(0) if "bytes" in row else pd.Series(0.0, index=ranks)
            thr = (nbytes / (s / 1e9)).replace([np.inf, -np.inf], np.nan) if float(nbytes.sum()) else None
            by.append({"collective": name, "normal_worker": normal,
                       "bottleneck_ratio": round(float(row.loc[normal, "exclusive_ns"] / window[normal]), 4),
                       "mean_throughput_Bps": round(float(thr.mean()), 1) if thr is not None else None,
                       "throughput_std_Bps": round(float(thr.std()), 1) if thr is not None else None,
                       "median_time_ms": round(float(s.median()) / 1e6, 3),
                       "abnormal_workers": _abnormal(s, window, z_threshold, FLOOR, both_sides=True)})
        report["communication"] = {"by_collective": by,
                                   "note": "in synchronous training the slow worker waits least: long collective "
                                           "time marks the ranks that wait for it"}
    else:
        report["not_applicable"].append("communication: no collectives in this window")
    # CUDA runtime ---------------------------------------------------------------------------
    if "runtime" in cats:
        rt = _per_rank(df, ("runtime",), "exclusive_ns", ranks)
        tot = _per_rank(df, ("runtime",), "total_ns", ranks)
        report["cuda_runtime"] = {"bottleneck_ratio": round(float((rt / window).median()), 4),
                                  "share_of_window": round(float((tot / window).median()), 4),
                                  "abnormal_workers": _abnormal(tot, window, z_threshold, FLOOR)}
    else:
        report["not_applicable"].append("cuda_runtime: no CUDA runtime calls in this window")
    # Python functions -------------------------------------------------------------------------
    py = df[df["category"] == "python"]
    if not py.empty:
        py = py.assign(ratio=py["exclusive_ns"] / py["rank"].map(window))
        heavy = py[py["ratio"] > FLOOR].sort_values("ratio", ascending=False)
        report["python_functions"] = {
            "per_worker": {str(r): [{"path": n, "bottleneck_ratio": round(float(x), 4)}
                                    for n, x in zip(g["name"], g["ratio"], strict=True)][:20]
                           for r, g in heavy.groupby("rank")}}
    else:
        report["not_applicable"].append("python_functions: no Python stacks in this window")
    # Slow workers and causes --------------------------------------------------------------------
    typical = typical_exclusive(df)
    busy = _per_rank(typical, BUSY_CATS, "typical_exclusive_ns", ranks)
    waits = host_waits(df, ranks)
    if waits is not None:
        waits["host_busy"] = _per_rank(typical, HOST_BUSY_CATS, "typical_exclusive_ns", ranks)
        report["host_cpu_wait_ms"] = {str(r): round(float(v) / 1e6, 3) for r, v in waits["runq"].items()}
        report["host_cpu_wait_share"] = {str(r): round(float(w), 3) for r, w in waits["share"].items()}
    report["slow_workers"], report["slow_only_by_cpu_wait"] = slow_workers(
        busy, waits, window, z_threshold, min_rel_excess)
    slow = report["slow_workers"]
    report["busy_ms"] = {str(r): round(float(v) / 1e6, 3) for r, v in busy.items()}
    report["causes"] = rank_causes(df, [s["rank"] for s in slow], ranks, world)
    if arrivals is not None and not arrivals.empty:
        report["collective_arrivals"] = straggler_from_arrivals(arrivals, world)
    report["abnormal_workers"] = sorted({s["rank"] for s in slow})
    report["bottleneck_ratio_by_category"] = bottleneck_by_category(df, window)
    return report


def host_waits(df: pd.DataFrame, ranks: list[int]) -> pd.DataFrame | None:
    """Per rank (the index), its training thread's wait for a CPU over the window, from the
    summaries' ``thread_cpu``: ``runq`` (ns waiting), ``ready`` (ns on a CPU or waiting for one) and
    ``share`` (``runq / ready``). None unless every rank sent it (older ranks, no schedstat)."""
    if "thread_runq_ns" not in df or "thread_cpu_ns" not in df:
        return None
    per = df.groupby("rank")[["thread_cpu_ns", "thread_runq_ns"]].max().reindex(ranks)
    if per.isna().any().any():
        return None
    runq = per["thread_runq_ns"].astype(float)
    ready = runq + per["thread_cpu_ns"].astype(float)
    return pd.DataFrame({"runq": runq, "ready": ready, "share": (runq / ready.where(ready > 0)).fillna(0.0)})


def slow_workers(busy: pd.Series, waits: pd.DataFrame | None, window: pd.Series, z_threshold: float,
                 min_rel_excess: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(slow, only_by_wait)``: the slow workers of a window, and the workers slow in wall time only
    by waiting for a CPU.

    A worker is slow when its busy time is abnormal (``flag_slow``), at least ``min_rel_excess``
    above the other workers' median and 1% of the window above it. Where every rank sent its
    training thread's run-queue wait (``waits``: :func:`host_waits` and each rank's ``host_busy``), its wait beyond what
    its peers' share would give over its ready time (``runq - peers' share x ready``, at most its
    host busy time) is taken off its busy time first: ranks that share cores with other work take
    turns, and over a short window whichever got a CPU less readily looks slower though its work is
    not. A compute straggler is ready to run longer and so waits longer, but at its peers' share:
    nothing is taken off. A worker slow in wall time and not without that wait is slow
    only when its thread got a CPU at most half as readily as its peers'
    (``stream_processors/cpu_wait.py``: ``held_back_by_host`` true, its host holds the job back);
    otherwise it is listed in ``only_by_wait``.
    """
    ranks = [int(r) for r in busy.index]
    if len(ranks) < 3:
        return [], []
    wall = {r: float(busy[r]) for r in ranks}
    flags, base = flag_slow(wall, z_threshold, min_rel_excess), peer_z(wall)
    slow: list[dict[str, Any]] = []
    only_by_wait: list[dict[str, Any]] = []
    for r in ranks:
        z, flagged = flags[r]
        b = base[r].baseline
        if not (flagged and wall[r] - b > FLOOR * window[r]):
            continue
        row: dict[str, Any] = {"rank": r, "busy_ms": round(wall[r] / 1e6, 3), "median_busy_ms": round(b / 1e6, 3),
                               "z": round(float(z), 2)}
        if waits is None:
            slow.append(row)
            continue
        w = waits.loc[r]
        peers = float(waits["share"].drop(r).median())
        extra = min(max(0.0, float(w["runq"]) - peers * float(w["ready"])), float(w["host_busy"]))
        rest = wall[r] - extra
        row.update(extra_cpu_wait_ms=round(extra / 1e6, 3), cpu_wait_share=round(float(w["share"]), 3),
                   peers_cpu_wait_share=round(peers, 3))
        if rest > b * (1 + min_rel_excess) and rest - b > FLOOR * window[r]:
            slow.append({**row, "held_back_by_host": False})
        elif starved(float(w["share"]), peers):
            slow.append({**row, "held_back_by_host": True})
        else:
            only_by_wait.append(row)
    return slow, only_by_wait


def without_own_frames(summaries: pd.DataFrame) -> pd.DataFrame:
    """Drop the Python call paths that hold any of rankscope's own frames
    (:func:`rankscope.own_frames.has_own_frame`: its threads, wrappers and ``tracer.step()``).

    The user's paths that enclose them keep their time: frames open across the whole window (the
    training loop) are compared as a share of the window in ``rank_causes``, where the tracer's
    time is the same on every rank; subtracting it would leave the loop's time small and noisy.
    """
    py = summaries["category"] == "python"
    is_own = py & summaries["name"].astype(str).map(has_own_frame).astype(bool)
    return summaries[~is_own].copy()


def typical_exclusive(df: pd.DataFrame) -> pd.DataFrame:
    """Add ``typical_exclusive_ns``: exclusive time with each function's calls at their median cost.

    ``exclusive_ns x min(1, count x median_ns / total_ns)``: one call stretched by a preemption or a
    page fault (common when ranks share cores) does not make a worker slow; a worker whose calls
    are all slower, or that makes more of them, is. Without ``median_ns`` (summaries of other
    origin) it is the exclusive time.
    """
    out = df.copy()
    excl = out["exclusive_ns"].astype(float)
    if "median_ns" not in out:
        out["typical_exclusive_ns"] = excl
        return out
    typical = out["count"].astype(float) * out["median_ns"].astype(float)
    factor = (typical / out["total_ns"].astype(float).where(out["total_ns"] > 0)).clip(upper=1.0).fillna(1.0)
    out["typical_exclusive_ns"] = excl * factor
    return out


def rank_causes(df: pd.DataFrame, slow_ranks: list[int], ranks: list[int], world: int,
                top: int = 10) -> list[dict[str, Any]]:
    """Functions of the slow workers by their excess over the other workers' median (inclusive time;
    for Python paths, the median share of the window).

    Python causes are call paths on the training thread (paths rooted at a thread's
    ``_bootstrap`` frame are other threads: in synchronous training the training thread's own
    path shows any wait on them). Of a chain of paths carrying the same excess, one is named:
    see ``_python_causes``.
    """
    out = []
    window = df.groupby("rank")["window_ns"].max().astype(float)
    comp = df[df["category"].isin(COMPUTE_CATS)]
    for r in slow_ranks:
        others = [x for x in ranks if x != r]
        mine = comp[comp["rank"] == r]
        per_rank = (comp[comp["rank"].isin(others)]
                    .pivot_table(index=["category", "name"], columns="rank", values="total_ns", aggfunc="sum")
                    .reindex(columns=others).fillna(0))
        # Python frames open across the window (main, the training loop) last as long as the
        # window, and windows of different ranks differ in length (profiler start-up, waiting): a
        # Python path is compared as a share of each rank's window, scaled to this rank's window.
        is_py = per_rank.index.get_level_values("category") == "python"
        shares = per_rank.div(window.reindex(others).to_numpy(), axis=1).median(axis=1) * float(window[r])
        rest = per_rank.median(axis=1).where(~is_py, shares)
        mine_out = []
        for (cat, name), total in mine.groupby(["category", "name"])["total_ns"].sum().items():
            if cat == "python" and THREAD_ROOT in str(name).split(";")[0]:
                continue
            excess = float(total) - float(rest.get((cat, name), 0.0))
            if excess > 0:
                mine_out.append({"rank": r, "category": cat, "function": name, "leaf": str(name).split(";")[-1],
                                 "excess_ms": round(excess / 1e6, 3),
                                 "cost_rank_seconds": round(excess * world / 1e9, 6), "_excess": excess,
                                 "_total": float(total)})
        out += [{k: v for k, v in c.items() if not k.startswith("_")} for c in _python_causes(mine_out)]
    out.sort(key=lambda c: c["excess_ms"], reverse=True)
    # An op's time is spent inside some Python function: when a Python call path carries at least
    # half the largest excess, it is the first cause (the function to look at; the ops follow).
    py = next((c for c in out if c["category"] == "python"), None)
    if py is not None and out and out[0] is not py and py["excess_ms"] >= 0.5 * out[0]["excess_ms"]:
        out.remove(py)
        out.insert(0, py)
    return out[:top]


def _python_causes(cands: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cause per chain of Python call paths that carry the same excess.

    The origin of an excess is the shallowest path where the slow worker diverges from the
    others: at least half of the path's own time is excess (``slow_extra_compute``, absent on
    the other ranks, not ``main`` around it, where the excess is a small part). The origin's
    descendants are its internals and are left out; a path that is no origin is left out when a
    descendant carries at least half its excess (the deeper path says more). Other categories
    pass through.
    """
    py = {str(c["function"]): c for c in cands if c["category"] == "python"}

    def ancestors(p: str) -> list[str]:
        f = p.split(";")
        return [";".join(f[:i]) for i in range(1, len(f))]

    high = {p for p, c in py.items() if c["_excess"] >= 0.5 * max(c["_total"], 1.0)}
    origins = {p for p in high if not any(a in high for a in ancestors(p))}
    out = []
    for c in cands:
        p = str(c["function"])
        if c["category"] == "python" and p not in origins:
            if any(a in origins for a in ancestors(p)):
                continue
            if any(q.startswith(p + ";") and d["_excess"] >= 0.5 * c["_excess"] for q, d in py.items()):
                continue
        out.append(c)
    return out


def straggler_from_arrivals(arrivals: pd.DataFrame, world: int) -> dict[str, Any]:
    """Match the k-th call of each collective across ranks; the last to arrive is the straggler.

    Returns who arrives last most often, their mean lateness behind the median arrival, every
    rank's mean lateness behind the median arrival (negative: early), and the what-if saving: sum over calls of (last arrival - second-to-last arrival) x world size.
    """
    a = arrivals.copy()
    n_ranks = a["rank"].nunique()
    g = a.groupby(["name", "seq"])
    full = g["rank"].transform("nunique") == n_ranks
    a = a[full]
    if a.empty or n_ranks < 2:
        return {"matched_calls": 0}
    last_rows = a.loc[a.groupby(["name", "seq"])["start_ns"].idxmax()]
    counts = last_rows["rank"].value_counts()
    med = a.groupby(["name", "seq"])["start_ns"].median()
    late = (last_rows.set_index(["name", "seq"])["start_ns"] - med)
    med_of = a.join(med.rename("med_ns"), on=["name", "seq"])
    by_rank = (med_of["start_ns"] - med_of["med_ns"]).groupby(med_of["rank"]).mean()
    second = a.groupby(["name", "seq"])["start_ns"].apply(lambda s: s.nlargest(2).iloc[-1])
    saving = (last_rows.set_index(["name", "seq"])["start_ns"] - second).clip(lower=0)
    top_rank = int(counts.idxmax())
    return {"matched_calls": int(len(last_rows)), "last_arrival_counts": {str(k): int(v) for k, v in counts.items()},
            "straggler": top_rank, "straggler_share": round(float(counts.max() / len(last_rows)), 3),
            "mean_lateness_ms": round(float(late.mean()) / 1e6, 3),
            "mean_lateness_ms_by_rank": {str(int(r)): round(float(v) / 1e6, 3) for r, v in by_rank.items()},
            "what_if_saving_rank_seconds": round(float(saving.sum()) * world / 1e9, 6)}


def bottleneck_by_category(df: pd.DataFrame, window: pd.Series) -> dict[str, float]:
    """Per event category, the median over workers of (exclusive time of the category / window)."""
    excl = df.groupby(["category", "rank"])["exclusive_ns"].sum().unstack(fill_value=0)
    excl = excl.reindex(columns=window.index, fill_value=0).astype(float)
    ratio = excl.div(window.to_numpy(), axis=1).median(axis=1)
    return {str(c): round(float(v), 4) for c, v in ratio.sort_values(ascending=False).items()}
