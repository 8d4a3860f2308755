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
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pandas as pd

from rankscope.offline.kineto_table import CATEGORIES, GPU_WORK_CATEGORIES, events_frame

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

_RANK_IN_NAME_RE = re.compile(r"rank[-_.]?(\d+)", re.IGNORECASE)

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


def _detect_unit(meta: Mapping[str, Any], ts: list[Any]) -> str:
    if not ts:
        return "us"
    all_int = all(type(t) is int for t in ts)
    if str(meta.get("displayTimeUnit", "")).lower() == "ns" and all_int:
        return "ns"
    if max(abs(float(t)) for t in ts) >= _NS_MAGNITUDE:
        return "ns"
    return "us"



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
    df = events_frame(events, rank, time_unit, stats, extra_columns)
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
        return events_frame([], 0, "us", {})
    if len(frames) == 1:
        return frames[0]
    from pandas.api.types import union_categoricals

    out = pd.concat(frames, ignore_index=True)
    for col in ("name", "raw_cat", "ph"):
        out[col] = union_categoricals([f[col] for f in frames])
    out["cat"] = pd.Categorical(out["cat"].astype(object), categories=CATEGORIES)
    return out
