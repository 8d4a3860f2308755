"""Exports that other tools load back. Pure: tables in, JSON-able dicts or text out.

- :func:`kineto_trace`: one rank's events table (``kineto.load_trace``) as a Kineto (torch.profiler
  chrome-trace) document: complete events with their own category, pid/tid, stream, correlation
  and ``External id``, collective metadata under Kineto's keys, ``ac2g`` flows from each runtime
  launch to the GPU work it launched, and the source's metadata (``distributedInfo``,
  ``deviceProperties`` ...). HTA, TensorBoard and ``rankscope analyze`` load it.
- :func:`merged_chrome_trace`: every rank in one Chrome/Perfetto trace (one process per rank and
  device, threads per host thread and stream), with the same launch -> kernel flow arrows.
- :func:`stored_events_table`: one rank's events of a stored window (``trace_events``) as the
  reader's table, so the two exports above serve stored windows too.
- :func:`folded_stacks` and :func:`speedscope`: Python call paths of window summaries (``rank,
  category, name, exclusive_ns``; ``name`` is ``root;...;leaf``) weighted by their self time, for
  flame graph tools (``flamegraph.pl``, speedscope, inferno). rankscope's own frames are folded into
  the user's call that made them, as in the flame graph (:func:`rankscope.own_frames.fold_path`).

Times keep the source's unit in :func:`kineto_trace` (``time_unit``), so a reader sees the numbers
the original held; the merged trace is in µs, as Chrome traces are.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from rankscope.own_frames import fold_path
from rankscope.taxonomy import GPU_WORK, RUNTIME_TYPES

__all__ = ["folded_stacks", "kineto_trace", "merged_chrome_trace", "speedscope", "stored_events_table"]

# Reader's collective arg names -> Kineto's own keys (the inverse of the reader's renaming).
_KINETO_ARG_KEYS = {
    "collective": "Collective name", "in_msg_nelems": "In msg nelems", "out_msg_nelems": "Out msg nelems",
    "in_split_size": "In split size", "out_split_size": "Out split size", "dtype": "dtype",
    "group_size": "Group size", "pg_name": "Process Group Name", "pg_desc": "Process Group Description",
    "pg_ranks": "Process Group Ranks",
}
_NEED = ("name", "cat", "raw_cat", "ph", "ts_ns", "dur_ns", "pid", "tid", "stream", "correlation", "external_id")


def _require(events: pd.DataFrame) -> None:
    missing = [c for c in _NEED if c not in events.columns]
    if missing:
        raise ValueError(f"events table lacks columns {missing}; load it with kineto.load_trace")


def _time(ns: np.ndarray, unit: str) -> list[Any]:
    """ns -> the unit's numbers: ns as ints; µs as ints when whole, else floats with ns precision."""
    if unit == "ns":
        return ns.tolist()
    whole = ns % 1000 == 0
    return [int(v // 1000) if w else round(v / 1000, 3) for v, w in zip(ns.tolist(), whole.tolist(), strict=True)]


def _args(row_args: Any, stream: int, corr: int, ext: int, is_gpu: bool, is_runtime: bool,
          extra: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(row_args, Mapping):
        out.update({_KINETO_ARG_KEYS.get(str(k), str(k)): v for k, v in row_args.items() if not str(k).endswith("_bytes")})
    if is_gpu and stream >= 0:
        out["stream"] = stream
    if corr >= 0 and (is_gpu or is_runtime):
        out["correlation"] = corr
    if ext >= 0:
        out["External id"] = ext
    out.update(extra)
    return out


def _events(events: pd.DataFrame, unit: str, pid_of: Any = None, flow_id: Any = None) -> list[dict[str, Any]]:
    """Complete/instant events plus ac2g flows (``flow_id(correlation)`` names a flow)."""
    n = len(events)
    ts = _time(events["ts_ns"].to_numpy(dtype=np.int64), unit)
    dur = _time(np.maximum(events["dur_ns"].to_numpy(dtype=np.int64), 0), unit)
    names = events["name"].astype(str).tolist()
    raw = events["raw_cat"].astype(str).tolist()
    cats = events["cat"].astype(str).tolist()
    phs = events["ph"].astype(str).tolist()
    pid = events["pid"].to_numpy(dtype=np.int64).tolist()
    tid = events["tid"].to_numpy(dtype=np.int64).tolist()
    stream = events["stream"].to_numpy(dtype=np.int64).tolist()
    corr = events["correlation"].to_numpy(dtype=np.int64).tolist()
    ext = events["external_id"].to_numpy(dtype=np.int64).tolist()
    args = events["args"].tolist() if "args" in events.columns else [None] * n
    py_id = events["py_id"].tolist() if "py_id" in events.columns else [-1] * n
    py_parent = events["py_parent"].tolist() if "py_parent" in events.columns else [-1] * n
    nbytes = events["bytes"].tolist() if "bytes" in events.columns else [0] * n
    out: list[dict[str, Any]] = []
    launches: dict[int, int] = {}
    gpu_rows: list[int] = []
    for i in range(n):
        is_gpu = cats[i] in GPU_WORK or raw[i] == "gpu_user_annotation"
        is_runtime = cats[i] == "runtime" or raw[i].lower() in RUNTIME_TYPES
        extra: dict[str, Any] = {}
        if py_id[i] >= 0:
            extra["Python id"] = py_id[i]
        if py_parent[i] >= 0:
            extra["Python parent id"] = py_parent[i]
        if nbytes[i] > 0:
            extra["bytes"] = nbytes[i]
        p = pid_of(i, pid[i], is_gpu) if pid_of else (pid[i] if pid[i] >= 0 else 0)
        t = tid[i] if tid[i] >= 0 else (stream[i] if stream[i] >= 0 else 0)
        e: dict[str, Any] = {"ph": phs[i] or "X", "cat": raw[i] or cats[i], "name": names[i], "pid": p, "tid": t,
                             "ts": ts[i]}
        if e["ph"] == "X":
            e["dur"] = dur[i]
        a = _args(args[i], stream[i], corr[i], ext[i], is_gpu, is_runtime, extra)
        if a:
            e["args"] = a
        out.append(e)
        if is_runtime and corr[i] >= 0:
            launches[corr[i]] = len(out) - 1
        elif cats[i] in GPU_WORK and corr[i] >= 0:
            gpu_rows.append(len(out) - 1)
    for k in gpu_rows:
        g = out[k]
        src = launches.get(g["args"]["correlation"])
        if src is None:
            continue
        h = out[src]
        fid = flow_id(g["args"]["correlation"]) if flow_id else g["args"]["correlation"]
        out.append({"ph": "s", "id": fid, "pid": h["pid"], "tid": h["tid"], "ts": h["ts"], "cat": "ac2g",
                    "name": "ac2g"})
        out.append({"ph": "f", "id": fid, "pid": g["pid"], "tid": g["tid"], "ts": g["ts"], "cat": "ac2g",
                    "name": "ac2g", "bp": "e"})
    return out


def kineto_trace(events: pd.DataFrame, metadata: Mapping[str, Any] | None = None, time_unit: str = "us"
                 ) -> dict[str, Any]:
    """One rank's events as a Kineto trace document (see the module docstring).

    ``metadata``: the source file's top-level keys (``Trace.metadata``), kept as they are;
    ``time_unit``: ``"us"`` (Kineto's own) or ``"ns"`` (``Trace.time_unit`` of an ns source).
    Raises ValueError on a table without the reader's columns or a bad unit."""
    if time_unit not in ("us", "ns"):
        raise ValueError(f"time_unit must be 'us' or 'ns', got {time_unit!r}")
    _require(events)
    doc: dict[str, Any] = {k: v for k, v in (metadata or {}).items() if k != "traceEvents"}
    if time_unit == "ns":
        doc["displayTimeUnit"] = "ns"
    elif str(doc.get("displayTimeUnit", "")).lower() == "ns":
        doc["displayTimeUnit"] = "ms"
    doc["traceEvents"] = _events(events, time_unit)
    return doc


def merged_chrome_trace(traces: Mapping[int, pd.DataFrame], job: str = "",
                        other: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """All ranks' events in one Chrome/Perfetto trace: process ``rank R`` (host) and ``rank R GPU D``
    per device, flows launch -> GPU work per rank. Times in µs. ``other``: more ``otherData`` keys.
    Raises ValueError like :func:`kineto_trace`."""
    out: list[dict[str, Any]] = []
    for rank in sorted(traces):
        ev = traces[rank]
        _require(ev)
        host_pid = (rank + 1) * 1000
        seen: dict[int, str] = {host_pid: f"rank {rank}"}

        def pid_of(_i: int, pid: int, is_gpu: bool, rank: int = rank, host_pid: int = host_pid,
                   seen: dict[int, str] = seen) -> int:
            if not is_gpu:
                return host_pid
            p = host_pid + 1 + max(pid, 0)
            seen.setdefault(p, f"rank {rank} GPU {max(pid, 0)}")
            return p

        out += _events(ev, "us", pid_of=pid_of, flow_id=lambda c, rank=rank: (rank << 40) | int(c))
        for p, label in seen.items():
            out.append({"ph": "M", "name": "process_name", "pid": p, "tid": 0, "args": {"name": label}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": p, "tid": 0, "args": {"sort_index": p}})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"producer": "rankscope", "job": job, "ranks": sorted(int(r) for r in traces),
                          **(other or {})}}


# Stored attrs (producers/categories.py ``attrs_and_bytes``) -> the reader's arg names.
_STORED_ARG_KEYS = {"op": "collective", "pg": "pg_name", "pg_desc": "pg_desc", "group_size": "group_size",
                    "dtype": "dtype", "in_nelems": "in_msg_nelems", "out_nelems": "out_msg_nelems"}
_BACKEND_ANNOTATION = ("nccl:", "rccl:", "gloo:", "mpi:", "ucc:", "xccl:", "hccl:")
#: Process id of a stored window's host events in its Kineto export (GPU work: the device index).
STORED_HOST_PID = 1_000_000
STORED_COLUMNS = ("category", "name", "start_ns", "dur_ns", "device", "stream", "step", "bytes", "attrs",
                  "correlation", "external_id")


def _stored_value(v: Any) -> Any:
    try:
        return json.loads(v) if isinstance(v, str) else v
    except ValueError:
        return v


def _raw_cat(cat: str, gpu: bool, name: str, attrs: Mapping[str, Any]) -> tuple[str, str]:
    """(reader category, Kineto category) of a stored event."""
    if cat == "collective":
        if gpu:
            return "kernel", "kernel"
        return cat, "user_annotation" if name.startswith(_BACKEND_ANNOTATION) else "cpu_op"
    if cat == "annotation":
        return cat, "gpu_user_annotation" if gpu else str(attrs.get("type", "user_annotation"))
    raw = {"kernel": "kernel", "memcpy": "gpu_memcpy", "memset": "gpu_memset", "runtime": "cuda_runtime",
           "cpu_op": "cpu_op", "python": "python_function"}.get(cat, cat)
    return cat, raw


def stored_events_table(events: pd.DataFrame, base_ns: int = 0) -> pd.DataFrame:
    """One rank's stored trace events (``storage/windows.py`` ``trace_events``: :data:`STORED_COLUMNS`)
    as the reader's events table (``kineto.load_trace(extra_columns=True)``), for :func:`kineto_trace`
    and :func:`merged_chrome_trace`.

    ``ts_ns`` = ``start_ns - base_ns``; GPU work sits on process = device and thread = stream (its
    ``stream`` arg too, except on GPU annotations, which Kineto writes without one), host
    events on process :data:`STORED_HOST_PID` and their thread (``attrs["tid"]`` if kept, else 0);
    Python events are named by their own frame (the leaf of the stored call path); collective attrs
    take the reader's arg names; a runtime call gets the external id of the GPU work it launched.
    Rows without ids (windows stored before they were) simply have no flows. Raises ValueError
    naming missing columns."""
    missing = [c for c in STORED_COLUMNS if c not in events.columns]
    if missing:
        raise ValueError(f"stored events lack columns {missing}")
    n = len(events)
    device = events["device"].to_numpy(dtype=np.int64)
    gpu = device >= 0
    cats, raws, names, args, tids = [], [], [], [], []
    for cat, name, a, g in zip(events["category"].astype(str), events["name"].astype(str), events["attrs"],
                               gpu.tolist(), strict=True):
        a = a if isinstance(a, Mapping) else {}
        c, raw = _raw_cat(cat, g, name, a)
        cats.append(c)
        raws.append(raw)
        names.append(name.rsplit(";", 1)[-1] if cat == "python" else name)
        tid = _stored_value(a.get("tid", 0))
        tids.append(tid if isinstance(tid, int) and not g else 0)
        kept = {_STORED_ARG_KEYS.get(k, k): _stored_value(v) for k, v in a.items() if k not in ("tid", "type")}
        args.append(kept or None)
    corr = events["correlation"].to_numpy(dtype=np.int64)
    ext = events["external_id"].to_numpy(dtype=np.int64).copy()
    runtime = np.array([c == "runtime" for c in cats], dtype=bool)
    if runtime.any():
        launched = pd.Series(ext[gpu & (corr >= 0) & (ext >= 0)], index=corr[gpu & (corr >= 0) & (ext >= 0)])
        launched = launched[~launched.index.duplicated()]
        fill = runtime & (ext < 0) & (corr >= 0)
        ext[fill] = launched.reindex(corr[fill]).fillna(-1).to_numpy(dtype=np.int64)
    nbytes = events["bytes"].to_numpy(dtype=np.int64)
    mem = np.isin(np.array(cats, dtype=object), ["memcpy", "memset"])
    return pd.DataFrame({
        "name": names, "cat": cats, "raw_cat": raws, "ph": ["X"] * n,
        "ts_ns": events["start_ns"].to_numpy(dtype=np.int64) - int(base_ns),
        "dur_ns": events["dur_ns"].to_numpy(dtype=np.int64),
        "pid": np.where(gpu, device, STORED_HOST_PID), "tid": np.where(gpu, events["stream"].to_numpy(dtype=np.int64),
                                                                       np.array(tids, dtype=np.int64)),
        "stream": np.where(gpu & (np.array(raws, dtype=object) != "gpu_user_annotation"),
                           events["stream"].to_numpy(dtype=np.int64), -1),
        "correlation": corr, "external_id": ext, "step": events["step"].to_numpy(dtype=np.int64),
        "args": pd.Series(args, dtype=object), "py_id": np.full(n, -1, dtype=np.int64),
        "py_parent": np.full(n, -1, dtype=np.int64), "bytes": np.where(mem, nbytes, 0),
    })


def _python_paths(functions: pd.DataFrame) -> pd.DataFrame:
    need = {"rank", "category", "name", "exclusive_ns"}
    if need - set(functions.columns):
        raise ValueError(f"function summaries lack columns {sorted(need - set(functions.columns))}")
    py = functions[(functions["category"] == "python") & (functions["exclusive_ns"] > 0)]
    py = py.assign(name=[fold_path(str(n)) for n in py["name"]])
    py = py[py["name"] != ""]
    return py.groupby(["rank", "name"], as_index=False)["exclusive_ns"].sum()


def folded_stacks(functions: pd.DataFrame, by_rank: bool = True) -> str:
    """Folded stacks (``frame;frame;leaf value`` per line, value = self time in µs) of the Python
    call paths; with ``by_rank`` each stack starts with a ``rank R`` frame."""
    py = _python_paths(functions)
    if not by_rank:
        py = py.groupby("name", as_index=False)["exclusive_ns"].sum().assign(rank=-1)
    lines = []
    for r, name, ns in zip(py["rank"], py["name"], py["exclusive_ns"], strict=True):
        us = int(round(float(ns) / 1000))
        if us > 0:
            stack = str(name).replace(" ", "_")
            lines.append(f"rank_{int(r)};{stack} {us}" if by_rank else f"{stack} {us}")
    return "\n".join(sorted(lines)) + ("\n" if lines else "")


def speedscope(functions: pd.DataFrame, name: str = "rankscope") -> dict[str, Any]:
    """A speedscope document: one ``sampled`` profile per rank, each call path a sample weighted by
    its self time (ns)."""
    py = _python_paths(functions)
    frames: list[dict[str, str]] = []
    index: dict[str, int] = {}
    profiles = []
    for r, g in py.groupby("rank", sort=True):
        samples, weights = [], []
        for path, ns in zip(g["name"], g["exclusive_ns"], strict=True):
            ids = []
            for f in str(path).split(";"):
                if f not in index:
                    index[f] = len(frames)
                    frames.append({"name": f})
                ids.append(index[f])
            samples.append(ids)
            weights.append(int(ns))
        profiles.append({"type": "sampled", "name": f"rank {int(r)}", "unit": "nanoseconds", "startValue": 0,
                         "endValue": int(sum(weights)), "samples": samples, "weights": weights})
    return {"$schema": "https://www.speedscope.app/file-format-schema.json", "name": name,
            "exporter": "rankscope", "activeProfileIndex": 0, "shared": {"frames": frames}, "profiles": profiles}
