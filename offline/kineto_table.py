"""Kineto trace events -> the typed events table (``kineto.Trace.events``; columns in
``kineto.py``'s docstring): normalised categories, collective metadata, ns times, steps. Pure.

:func:`events_frame` is the hot loop of every reader; ``kineto.py`` reads the files and calls it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from rankscope.taxonomy import CATEGORIES as TAXONOMY_CATEGORIES
from rankscope.taxonomy import GPU_WORK, dtype_bytes, is_collective_name

__all__ = ["CATEGORIES", "GPU_WORK_CATEGORIES", "events_frame"]

CATEGORIES: tuple[str, ...] = (*TAXONOMY_CATEGORIES, "other")
GPU_WORK_CATEGORIES: tuple[str, ...] = GPU_WORK

_BASE_CAT = {
    "kernel": "kernel",
    "gpu_memcpy": "memcpy",
    "memcpy": "memcpy",
    "gpu_memset": "memset",
    "memset": "memset",
    "runtime": "runtime",
    "cpu_op": "cpu_op",
    "operator": "cpu_op",
    "python_function": "python",
    "python": "python",
    "user_annotation": "annotation",
    "gpu_user_annotation": "annotation",
}
_PROFILER_STEP_RE = re.compile(r"^ProfilerStep\s*#\s*(\d+)")
_TRAILING_INT_RE = re.compile(r"(-?\d+)\s*$")

_COLLECTIVE_ARG_KEYS = {
    "Collective name": "collective",
    "In msg nelems": "in_msg_nelems",
    "Out msg nelems": "out_msg_nelems",
    "In split size": "in_split_size",
    "Out split size": "out_split_size",
    "dtype": "dtype",
    "Group size": "group_size",
    "Process Group Name": "pg_name",
    "Process Group Description": "pg_desc",
    "Process Group Ranks": "pg_ranks",
}

def _to_int(v: Any, cache: dict[str, int]) -> int:
    if type(v) is int:
        return v
    if isinstance(v, float) and math.isfinite(v):
        return int(v)
    if isinstance(v, str):
        r = cache.get(v)
        if r is None:
            m = _TRAILING_INT_RE.search(v)
            r = int(m.group(1)) if m else -1
            cache[v] = r
        return r
    return -1


def _arg_int(args: Mapping[str, Any], key: str) -> int:
    v = args.get(key)
    if type(v) is int:
        return v
    if isinstance(v, float) and math.isfinite(v):
        return int(v)
    return -1


def _collective_args(args: Mapping[str, Any]) -> dict[str, Any] | None:
    if "Collective name" not in args and "Process Group Name" not in args:
        return None
    out: dict[str, Any] = {}
    for raw, key in _COLLECTIVE_ARG_KEYS.items():
        if raw in args:
            out[key] = args[raw]
    ranks = out.get("pg_ranks")
    if isinstance(ranks, str):
        try:
            parsed = json.loads(ranks)
            if isinstance(parsed, list):
                out["pg_ranks"] = parsed
        except json.JSONDecodeError:
            pass
    size = dtype_bytes(out.get("dtype", ""))
    if size:
        for k in ("in_msg", "out_msg"):
            n = out.get(f"{k}_nelems")
            if isinstance(n, int):
                out[f"{k}_bytes"] = n * size
    return out


def to_ns(values: list[Any], unit: str) -> np.ndarray:
    if all(type(v) is int for v in values):
        arr = np.asarray(values, dtype=np.int64)
        return arr if unit == "ns" else arr * 1000
    f = np.asarray(values, dtype=np.float64)
    if unit == "ns":
        return np.rint(f).astype(np.int64)
    whole = np.floor(f)
    return whole.astype(np.int64) * 1000 + np.rint((f - whole) * 1000).astype(np.int64)


# --------------------------------------------------------------------------- table building


def _assign_steps(df: pd.DataFrame) -> np.ndarray:
    """Host events: the ProfilerStep whose [ts, ts+dur) holds their start. GPU work: the step of
    the host event with the same correlation id, else the GPU-side ProfilerStep copy holding it.
    GPU annotations: the GPU-side ProfilerStep copy holding them."""
    n = len(df)
    step = np.full(n, -1, dtype=np.int32)
    if n == 0:
        return step
    names = df["name"]
    cats = df["cat"].to_numpy()
    raw = df["raw_cat"].astype(str).to_numpy()
    ts = df["ts_ns"].to_numpy()
    dur = df["dur_ns"].to_numpy()
    is_gpu_work = np.isin(cats, GPU_WORK_CATEGORIES)
    is_gpu_ann = raw == "gpu_user_annotation"
    is_host = ~is_gpu_work & ~is_gpu_ann

    step_no = names.cat.categories.to_series().str.extract(_PROFILER_STEP_RE, expand=False)
    step_no = pd.to_numeric(step_no, errors="coerce").to_numpy()
    codes = names.cat.codes.to_numpy()
    ev_step = np.where(codes >= 0, step_no[np.clip(codes, 0, None)] if len(step_no) else np.nan, np.nan)
    is_step_ev = ~np.isnan(ev_step) & (df["ph"].astype(str).to_numpy() == "X")

    def contain(side: np.ndarray, target: np.ndarray) -> None:
        sel = is_step_ev & side
        if not sel.any():
            return
        order = np.argsort(ts[sel], kind="stable")
        s_ts, s_end, s_no = ts[sel][order], (ts[sel] + dur[sel])[order], ev_step[sel][order]
        idx = np.flatnonzero(target)
        pos = np.searchsorted(s_ts, ts[idx], side="right") - 1
        ok = pos >= 0
        pos_ok = np.clip(pos, 0, None)
        ok &= ts[idx] < s_end[pos_ok]
        step[idx[ok]] = s_no[pos_ok[ok]].astype(np.int32)

    contain(is_host, is_host)
    contain(is_gpu_ann, is_gpu_ann)

    corr = df["correlation"].to_numpy()
    host_corr = is_host & (corr >= 0) & (step >= 0)
    if host_corr.any() and is_gpu_work.any():
        link = pd.Series(step[host_corr], index=corr[host_corr])
        link = link[~link.index.duplicated(keep="last")]
        g = np.flatnonzero(is_gpu_work)
        mapped = link.reindex(corr[g]).to_numpy()
        got = ~np.isnan(mapped)
        step[g[got]] = mapped[got].astype(np.int32)
    unlinked = is_gpu_work & (step < 0)
    if unlinked.any():
        contain(is_gpu_ann, unlinked)
    return step


def events_frame(events: list[Any], rank: int, unit: str, stats: dict[str, int],
                  extra_columns: bool = False) -> pd.DataFrame:
    names: list[str] = []
    raw_cats: list[str] = []
    phs: list[str] = []
    ts_l: list[Any] = []
    dur_l: list[Any] = []
    pid_l: list[int] = []
    tid_l: list[int] = []
    stream_l: list[int] = []
    corr_l: list[int] = []
    ext_l: list[int] = []
    args_l: list[dict[str, Any] | None] = []
    py_id_l: list[int] = []
    py_parent_l: list[int] = []
    bytes_l: list[int] = []
    flows: list[tuple[str, Any, int, int, Any]] = []
    cache: dict[str, int] = {}
    skipped = 0
    bad_dur = 0
    num = (int, float)
    no_args: dict[str, Any] = {}
    # The hot loop of every reader: plain ints and strs take the inline path; anything odd goes
    # through the helpers (which give the same results).
    for e in events:
        if type(e) is not dict:
            skipped += 1
            continue
        ph = e.get("ph", "X")
        if ph == "M" or ph == "E" or ph == "e":
            continue
        raw_cat = e.get("cat")
        ts = e.get("ts")
        if ph == "s" or ph == "f" or ph == "t":
            if raw_cat == "ac2g" and type(ts) in num:
                flows.append((ph, e.get("id"), _to_int(e.get("pid"), cache), _to_int(e.get("tid"), cache), ts))
            continue
        if type(ts) not in num or raw_cat == "Trace":
            skipped += raw_cat != "Trace"
            continue
        d = e.get("dur", 0)
        if type(d) not in num or d < 0 or d != d:
            bad_dur += 1
            d = 0
        args = e.get("args")
        if type(args) is not dict:
            args = no_args
        n = e.get("name", "")
        names.append(n if type(n) is str else str(n))
        raw_cats.append(raw_cat if type(raw_cat) is str else str(raw_cat) if raw_cat is not None else "")
        phs.append(ph if type(ph) is str else str(ph))
        ts_l.append(ts)
        dur_l.append(d)
        v = e.get("pid")
        pid_l.append(v if type(v) is int else _to_int(v, cache))
        v = e.get("tid")
        tid_l.append(v if type(v) is int else _to_int(v, cache))
        if args:
            v = args.get("stream", -1)
            stream_l.append(v if type(v) is int else _arg_int(args, "stream"))
            v = args.get("correlation", -1)
            corr_l.append(v if type(v) is int else _arg_int(args, "correlation"))
            v = args.get("External id", -1)
            ext_l.append(v if type(v) is int else _arg_int(args, "External id"))
            args_l.append(_collective_args(args) if "Collective name" in args or "Process Group Name" in args
                          else None)
        else:
            stream_l.append(-1)
            corr_l.append(-1)
            ext_l.append(-1)
            args_l.append(None)
        if extra_columns:
            py_id_l.append(_arg_int(args, "Python id"))
            py_parent_l.append(_arg_int(args, "Python parent id"))
            b = _arg_int(args, "bytes")
            bytes_l.append(b if b > 0 else 0)
    if bad_dur:
        stats["bad_durations"] = stats.get("bad_durations", 0) + bad_dur
    stats["skipped_events"] = skipped
    stats["flows"] = len(flows)

    name_cat = pd.Categorical(names)
    raw_cat_cat = pd.Categorical(raw_cats)
    df = pd.DataFrame(
        {
            "rank": np.full(len(names), rank, dtype=np.int32),
            "name": name_cat,
            "cat": pd.Categorical(_normalise_cats(name_cat, raw_cat_cat, args_l), categories=CATEGORIES),
            "raw_cat": raw_cat_cat,
            "ph": pd.Categorical(phs),
            "ts_ns": to_ns(ts_l, unit) if ts_l else np.empty(0, np.int64),
            "dur_ns": to_ns(dur_l, unit) if dur_l else np.empty(0, np.int64),
            "pid": np.asarray(pid_l, dtype=np.int64),
            "tid": np.asarray(tid_l, dtype=np.int64),
            "stream": np.asarray(stream_l, dtype=np.int32),
            "correlation": np.asarray(corr_l, dtype=np.int64),
            "external_id": np.asarray(ext_l, dtype=np.int64),
            "step": np.full(len(names), -1, dtype=np.int32),
            "args": pd.Series(args_l, dtype=object),
        }
    )
    if extra_columns:
        df["py_id"] = np.asarray(py_id_l, dtype=np.int64)
        df["py_parent"] = np.asarray(py_parent_l, dtype=np.int64)
        df["bytes"] = np.asarray(bytes_l, dtype=np.int64)
    if flows:
        stats["correlations_from_flows"] = _fill_correlation_from_flows(df, flows, unit)
    df["step"] = _assign_steps(df)
    return df


def _normalise_cats(names: pd.Categorical, raw: pd.Categorical, args: list[dict[str, Any] | None]) -> np.ndarray:
    raw_names = list(raw.categories)
    base = np.array(
        [
            _BASE_CAT.get(c.lower(), "runtime" if c.lower().endswith(("_runtime", "_driver")) else "other")
            for c in raw_names
        ]
        + ["other"],
        dtype=object,
    )
    out = base[np.asarray(raw.codes)]  # code -1 (missing) maps to the trailing "other"
    coll_name = np.array([is_collective_name(n) for n in names.categories] + [False])
    is_coll = coll_name[np.asarray(names.codes)]
    host_side = np.isin(out, ("cpu_op", "annotation")) & (np.asarray(raw.astype(str)) != "gpu_user_annotation")
    has_coll_args = np.fromiter((a is not None for a in args), dtype=bool, count=len(args))
    out = np.where(host_side & (is_coll | has_coll_args), "collective", out)
    return out


def _fill_correlation_from_flows(df: pd.DataFrame, flows: list[tuple[str, Any, int, int, Any]], unit: str) -> int:
    """GPU work without ``args.correlation`` gets it from the ac2g flow that ends on it."""
    gpu = df["cat"].isin(GPU_WORK_CATEGORIES).to_numpy() & (df["correlation"].to_numpy() < 0)
    if not gpu.any():
        return 0
    fin = [(fid, pid, tid, ts) for ph, fid, pid, tid, ts in flows if ph == "f" and isinstance(fid, int)]
    if not fin:
        return 0
    f_ts = to_ns([f[3] for f in fin], unit)
    key = pd.DataFrame({"pid": [f[1] for f in fin], "tid": [f[2] for f in fin], "ts_ns": f_ts,
                        "fid": [f[0] for f in fin]}).drop_duplicates(["pid", "tid", "ts_ns"], keep="last")
    idx = np.flatnonzero(gpu)
    sub = df.loc[idx, ["pid", "tid", "ts_ns"]].reset_index()
    m = sub.merge(key, on=["pid", "tid", "ts_ns"], how="inner")
    if m.empty:
        return 0
    corr = df["correlation"].to_numpy().copy()
    corr[m["index"].to_numpy()] = m["fid"].to_numpy(dtype=np.int64)
    df["correlation"] = corr
    return len(m)
