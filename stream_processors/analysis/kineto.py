"""Kineto (torch.profiler chrome-trace) reader: one trace file -> one typed events DataFrame.

The reader is the only place that touches files; everything downstream (``breakdown.py``) is a
pure function over the DataFrame it returns.

Accepted input: gzip or plain JSON (detected from the content, not the suffix); a dict with
``traceEvents`` or a bare JSON array of events; timestamps in µs (integer, or float with ns
precision as written by recent Kineto) or in ns; with or without ``ac2g`` flows,
``deviceProperties``, ``distributedInfo`` and collective metadata; NVIDIA and AMD/ROCm names.

Events table (``Trace.events``), one row per trace event with a duration or an instant:

=============  ========  ===========================================================
column         dtype     meaning
=============  ========  ===========================================================
rank           int32     rank of the file
name           category  event name (kernel, op, Python frame ...)
cat            category  normalised: kernel, memcpy, memset, runtime, cpu_op, python,
                         annotation, collective, other (see :data:`CATEGORIES`)
raw_cat        category  the trace's own ``cat`` (e.g. ``gpu_user_annotation``)
ph             category  chrome-trace phase (``X`` complete, ``i`` instant, ...)
ts_ns, dur_ns  int64     start and duration in nanoseconds (source clock, not rebased)
pid, tid       int64     process / thread (GPU: device / stream); -1 when not numeric
stream         int32     GPU stream from args, -1 on the host
correlation    int64     CPU launch <-> GPU work link, -1 if none
external_id    int64     op <-> launch link (``External id``), -1 if none
step           int32     ProfilerStep number the event belongs to, -1 if none
args           object    dict of collective metadata where present, else None
=============  ========  ===========================================================

With ``extra_columns=True`` (used by ``rankscope replay``) three more columns follow:
``py_id`` and ``py_parent`` (int64, ``Python id`` / ``Python parent id`` of python_function
events, -1 if none) and ``bytes`` (int64, the ``bytes`` arg of memcpy/memset, else 0).
"""

from __future__ import annotations

import gc
import gzip
import json
import math
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd

__all__ = [
    "CATEGORIES",
    "GPU_WORK_CATEGORIES",
    "Trace",
    "TraceFormatError",
    "concat_events",
    "load_trace",
    "load_traces",
    "trace_files_in",
]

CATEGORIES: tuple[str, ...] = (
    "kernel", "memcpy", "memset", "runtime", "cpu_op", "python", "annotation", "collective", "other",
)
GPU_WORK_CATEGORIES: tuple[str, ...] = ("kernel", "memcpy", "memset")

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
# Host-side events that are collectives: c10d / ProcessGroup ops, "nccl:all_reduce" style annotations.
_CPU_COLLECTIVE_RE = re.compile(
    r"^(record_param_comms$|c10d::|c10d_functional::|_c10d_functional::|ProcessGroup\w*::|"
    r"(nccl|rccl|gloo|mpi|ucc|xccl|hccl):)"
)
_PROFILER_STEP_RE = re.compile(r"^ProfilerStep\s*#\s*(\d+)")
_RANK_IN_NAME_RE = re.compile(r"rank[-_.]?(\d+)", re.IGNORECASE)
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
_DTYPE_BYTES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
    "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "char": 1, "int8": 1,
    "byte": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complexfloat": 8,
    "complexdouble": 16,
}
# Absolute timestamps at or above this are nanoseconds: 1e17 µs would be the year 5138.
_NS_MAGNITUDE = 1e17


class TraceFormatError(ValueError):
    """A file is not a readable Kineto/chrome trace. The message names the file and the reason."""


@dataclass(frozen=True, eq=False)
class Trace:
    """One rank's trace: the events table plus what the file says about itself.

    Attributes:
        rank: rank of the trace (``distributedInfo.rank``, else from the file name, else 0).
        path: the file it came from.
        events: the events table described in the module docstring.
        metadata: top-level keys of the file other than ``traceEvents``.
        time_unit: unit of the source timestamps, ``"us"`` or ``"ns"`` (``ts_ns`` is always ns).
        rank_source: where ``rank`` came from: ``distributedInfo``, ``filename``, ``traceName``,
            ``argument`` or ``default``.
        stats: counts of what the reader skipped or inferred (events without ts, flows, ...).
    """

    rank: int
    path: str
    events: pd.DataFrame
    metadata: Mapping[str, Any] = field(default_factory=dict)
    time_unit: str = "us"
    rank_source: str = "default"
    stats: Mapping[str, int] = field(default_factory=dict)

    @property
    def steps(self) -> list[int]:
        """ProfilerStep numbers seen on the host, ascending."""
        s = self.events["step"]
        return sorted(int(x) for x in s[s >= 0].unique())

    @property
    def world_size(self) -> int | None:
        info = self.metadata.get("distributedInfo")
        if isinstance(info, Mapping) and isinstance(info.get("world_size"), int):
            return int(info["world_size"])
        return None

    @property
    def device_name(self) -> str | None:
        props = self.metadata.get("deviceProperties")
        if isinstance(props, list) and props and isinstance(props[0], Mapping):
            name = props[0].get("name")
            return str(name) if name is not None else None
        return None


# --------------------------------------------------------------------------- file reading


def _read_json(path: Path) -> Any:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read trace file: {e.strerror or e}") from e
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as e:
            raise TraceFormatError(f"{path}: corrupt or truncated gzip data ({e})") from e
    if not raw.strip():
        raise TraceFormatError(f"{path}: empty file, not a trace")
    try:
        return msgspec.json.decode(raw)   # ~2x the stdlib's speed; odd input falls back to it
    except (msgspec.DecodeError, ValueError):
        pass
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceFormatError(f"{path}: not a JSON trace (not UTF-8 text: {e.reason} at byte {e.start})") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        stripped = text.rstrip()
        # The chrome JSON-array format allows a missing closing bracket.
        if stripped.startswith("[") and not stripped.endswith("]"):
            try:
                return json.loads(stripped.rstrip(",") + "]")
            except json.JSONDecodeError:
                pass
        raise TraceFormatError(
            f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
            "is the file truncated or not a Kineto trace?"
        ) from e


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
    size = _DTYPE_BYTES.get(str(out.get("dtype", "")).lower().replace("c10::", ""))
    if size:
        for k in ("in_msg", "out_msg"):
            n = out.get(f"{k}_nelems")
            if isinstance(n, int):
                out[f"{k}_bytes"] = n * size
    return out


def _detect_unit(meta: Mapping[str, Any], ts: list[Any]) -> str:
    if not ts:
        return "us"
    all_int = all(type(t) is int for t in ts)
    if str(meta.get("displayTimeUnit", "")).lower() == "ns" and all_int:
        return "ns"
    if max(abs(float(t)) for t in ts) >= _NS_MAGNITUDE:
        return "ns"
    return "us"


def _to_ns(values: list[Any], unit: str) -> np.ndarray:
    if all(type(v) is int for v in values):
        arr = np.asarray(values, dtype=np.int64)
        return arr if unit == "ns" else arr * 1000
    f = np.asarray(values, dtype=np.float64)
    if unit == "ns":
        return np.rint(f).astype(np.int64)
    whole = np.floor(f)
    return whole.astype(np.int64) * 1000 + np.rint((f - whole) * 1000).astype(np.int64)


def _rank_of(meta: Mapping[str, Any], path: Path) -> tuple[int, str]:
    info = meta.get("distributedInfo")
    if isinstance(info, Mapping):
        r = info.get("rank")
        if isinstance(r, int) and not isinstance(r, bool) and r >= 0:
            return r, "distributedInfo"
        if isinstance(r, str) and r.isdigit():
            return int(r), "distributedInfo"
    m = _RANK_IN_NAME_RE.search(path.name)
    if m:
        return int(m.group(1)), "filename"
    trace_name = meta.get("traceName")
    if isinstance(trace_name, str):
        m = _RANK_IN_NAME_RE.search(Path(trace_name).name)
        if m:
            return int(m.group(1)), "traceName"
    return 0, "default"


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


def _events_frame(events: list[Any], rank: int, unit: str, stats: dict[str, int],
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
            "ts_ns": _to_ns(ts_l, unit) if ts_l else np.empty(0, np.int64),
            "dur_ns": _to_ns(dur_l, unit) if dur_l else np.empty(0, np.int64),
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
    coll_name = np.array([bool(_CPU_COLLECTIVE_RE.match(n)) for n in names.categories] + [False])
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
    f_ts = _to_ns([f[3] for f in fin], unit)
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


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Cyclic GC off while a trace is decoded and tabled: the decoded JSON is millions of
    containers, and the collections their allocation triggers walked all of them (~25% of a
    64-rank ``analyze`` run). No cycles are made here; reference counting still frees everything.
    Restores the previous state (nesting and callers that disabled GC themselves are fine)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# --------------------------------------------------------------------------- public API


def load_trace(path: str | Path, *, rank: int | None = None, time_unit: str = "auto",
               extra_columns: bool = False) -> Trace:
    """Read one Kineto trace file.

    Args:
        path: a ``.json`` or ``.json.gz`` trace (gzip is detected from the content).
        rank: force the rank instead of reading it from the file.
        time_unit: ``"auto"`` (default), ``"us"`` or ``"ns"``: the unit of ``ts``/``dur`` in the
            file. ``auto`` reads ns when ``displayTimeUnit`` is ``"ns"`` and every timestamp is
            an integer, or when timestamps are at least 1e17 (epoch nanoseconds); otherwise µs,
            which is what Kineto writes (floats with three decimals carry ns precision).
        extra_columns: also keep ``py_id``, ``py_parent`` and ``bytes`` (see the module docstring).

    Returns:
        A :class:`Trace`; blocking, reads the whole file into memory.

    Raises:
        TraceFormatError (a ValueError) naming the file: unreadable, bad gzip, not JSON, no
        ``traceEvents``, or no timed events.
    """
    if time_unit not in ("auto", "us", "ns"):
        raise ValueError(f"time_unit must be 'auto', 'us' or 'ns', got {time_unit!r}")
    if rank is not None and rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    with _gc_paused():
        return _load_trace(Path(path), rank, time_unit, extra_columns)


def _load_trace(p: Path, rank: int | None, time_unit: str, extra_columns: bool) -> Trace:
    data = _read_json(p)
    if isinstance(data, list):
        meta: dict[str, Any] = {}
        events = data
    elif isinstance(data, dict):
        if "traceEvents" not in data:
            raise TraceFormatError(f"{p}: JSON without 'traceEvents': not a Kineto/chrome trace")
        events = data["traceEvents"]
        meta = {k: v for k, v in data.items() if k != "traceEvents"}
        if not isinstance(events, list):
            raise TraceFormatError(f"{p}: 'traceEvents' is a {type(events).__name__}, expected a list")
    else:
        raise TraceFormatError(f"{p}: top-level JSON {type(data).__name__} is not a trace")

    if rank is not None:
        rank_source = "argument"
    else:
        rank, rank_source = _rank_of(meta, p)
    if time_unit == "auto":
        sample = [
            e["ts"] for e in events
            if isinstance(e, dict) and isinstance(e.get("ts"), int | float) and e.get("ph") != "M"
        ]
        time_unit = _detect_unit(meta, sample)
    stats: dict[str, int] = {}
    df = _events_frame(events, rank, time_unit, stats, extra_columns)
    if df.empty:
        raise TraceFormatError(f"{p}: no timed events in 'traceEvents'")
    return Trace(rank=rank, path=str(p), events=df, metadata=meta, time_unit=time_unit,
                 rank_source=rank_source, stats=stats)


def trace_files_in(folder: str | Path) -> list[Path]:
    """Trace files directly inside ``folder`` (``*.json``, ``*.json.gz``), sorted by name."""
    d = Path(folder)
    return sorted(p for p in d.iterdir() if p.is_file() and p.name.endswith((".json", ".json.gz")))


def expand_paths(paths_or_folder: str | Path | Iterable[str | Path]) -> list[Path]:
    """The trace files named by files, folders of files, or one folder (non-recursive).

    Raises ValueError: no paths, a path does not exist, or a folder holds no trace file.
    """
    if isinstance(paths_or_folder, str | Path):
        items: list[str | Path] = [paths_or_folder]
    else:
        items = list(paths_or_folder)
    if not items:
        raise ValueError("no trace paths given")
    files: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = trace_files_in(p)
            if not found:
                raise ValueError(f"{p}: folder holds no trace files (*.json, *.json.gz)")
            files.extend(found)
        elif p.exists():
            files.append(p)
        else:
            raise ValueError(f"{p}: no such file or folder")
    return files


def load_traces(paths_or_folder: str | Path | Iterable[str | Path], *, time_unit: str = "auto",
                extra_columns: bool = False) -> dict[int, Trace]:
    """Read several traces (files, folders of files, or one folder) into ``{rank: Trace}``.

    Folders are expanded non-recursively to their ``*.json``/``*.json.gz`` files.
    ``extra_columns`` is passed to :func:`load_trace`.

    Raises:
        ValueError: a path does not exist, a folder holds no trace file, a file is not a trace
            (:class:`TraceFormatError`, naming the file), or two files carry the same rank.
    """
    files = expand_paths(paths_or_folder)
    traces: dict[int, Trace] = {}
    for f in files:
        t = load_trace(f, time_unit=time_unit, extra_columns=extra_columns)
        if t.rank in traces:
            raise ValueError(
                f"rank {t.rank} appears twice: {traces[t.rank].path} and {f} "
                f"(rank from {traces[t.rank].rank_source} and {t.rank_source})"
            )
        traces[t.rank] = t
    return dict(sorted(traces.items()))


def concat_events(traces: Mapping[int, Trace]) -> pd.DataFrame:
    """All ranks' events in one frame (categoricals unified), ordered by rank."""
    frames = [traces[r].events for r in sorted(traces)]
    if not frames:
        return _events_frame([], 0, "us", {})
    if len(frames) == 1:
        return frames[0]
    from pandas.api.types import union_categoricals

    out = pd.concat(frames, ignore_index=True)
    for col in ("name", "raw_cat", "ph"):
        out[col] = union_categoricals([f[col] for f in frames])
    out["cat"] = pd.Categorical(out["cat"].astype(object), categories=CATEGORIES)
    return out
