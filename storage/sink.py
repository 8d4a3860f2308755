"""The sink: Kafka -> ClickHouse, committing offsets only after the rows are in the store.

Pipeline per message (snuba's strategy chain, in one thread)::

    poll -> decode/validate -> convert to rows -> batch -> insert all tables -> commit offsets

- Decode: msgpack envelopes (:func:`rankscope.wire.decode`) on the steps, stats and hw topics, JSON
  on the alerts (:meth:`Alert.from_json`) and deadletter (:meth:`DeadLetter.from_json`) topics. A
  message that fails is produced to the deadletter topic (``stage="sink"``), counted, and its offset
  is committed with the batch; the sink never stops on bad input.
- Batch: closed at ``settings.sink_batch_rows`` rows or ``settings.sink_batch_s`` seconds after its
  first message (measured on the injected clock), whichever comes first.
- Write: one column-oriented insert per table, then the ``ranks``/``jobs`` upserts, then a flush of
  the dead letters produced for the batch, then a synchronous commit of the exact next offsets.
  A :class:`StoreError` leaves the batch uncommitted: the assignment is paused (the consumer keeps
  polling so it stays in the group) and the same batch is retried with exponential back-off. Tables
  already written are not written again; re-inserts would be harmless anyway (ReplacingMergeTree).
- Rebalance (eager protocol): on revoke the open batch gets one write attempt; if that fails it is
  dropped uncommitted and whoever owns the partitions next re-reads it.

``ranks`` and ``jobs`` are ReplacingMergeTree(last_seen_ns): every upsert row must be complete, so
the sink keeps the known state of each (job, rank) in memory, fills it from the store the first time
a job is seen by this process, and writes the merged state.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankscope.alerts import Alert
from rankscope.call_paths import expand_call_paths
from rankscope.clock import SYSTEM_CLOCK, Clock
from rankscope.config import Settings
from rankscope.deadletter import DeadLetter, DeadLetterCounter
from rankscope.kafka_client import client_conf
from rankscope.metrics import process_metrics
from rankscope.packed import unpack_int_columns
from rankscope.topics import Topic
from rankscope.wire import Envelope, WireError, decode, split_beat
from storage.store import Store, StoreError

log = logging.getLogger(__name__)


class _RepeatFilter(logging.Filter):
    """Drops a line identical to one let through less than ``window_s`` ago (librdkafka repeats
    "connection refused" several times a second while the broker is down)."""

    def __init__(self, window_s: float = 30.0) -> None:
        super().__init__()
        self.window_s = window_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key, now = record.getMessage(), time.monotonic()
        with self._lock:
            seen = self._last.get(key)
            if seen is not None and now - seen < self.window_s:
                return False
            if len(self._last) > 1000:
                self._last.clear()
            self._last[key] = now
        return True


# librdkafka's own log lines, routed into logging (delivered while the client is polled).
_client_log = logging.getLogger("rankscope.kafka.client.sink")
_client_log.addFilter(_RepeatFilter())

STAGE = "sink"
SINK_TOPICS = (Topic.STEPS, Topic.STATS, Topic.ALERTS, Topic.DEADLETTER, Topic.HW, Topic.TRACES, Topic.SUMMARIES,
               Topic.REPORTS, Topic.REPLIES, Topic.CONTROL)   # CONTROL: flight records from ranks that send them there
# Kinds the sink stores; other valid kinds on its topics are counted as skipped.
STORED_KINDS = frozenset({"steps", "heartbeat", "exit", "stats", "hw", "trace", "summary", "flight"})

_I64 = (-(2**63), 2**63 - 1)
_I32 = (-(2**31), 2**31 - 1)
_U32 = (0, 2**32 - 1)
_LO, _HI = _I64
_LO32, _HI32 = _I32

RANK_COLUMNS = ("job", "rank", "host", "pid", "local_rank", "world_size", "last_step", "last_seen_ns",
                "exit_reason", "exit_detail")
JOB_COLUMNS = ("job", "world_size", "first_seen_ns", "last_seen_ns")
TABLE_COLUMNS: dict[str, tuple[str, ...]] = {
    "steps": ("job", "rank", "step", "start_ns", "end_ns", "duration_ns", "comm_ns", "busy_ns", "host",
              "pid", "seq"),
    "heartbeats": ("job", "rank", "ts_ns", "step", "since_step_s", "dropped", "host", "pid", "seq", "stacks"),
    "worker_stats": ("job", "rank", "ts_ns", "step", "window_steps", "median_step_ns", "p95_step_ns",
                     "median_busy_ns", "median_comm_ns", "busy_z", "state"),
    "hw_samples": ("job", "rank", "host", "device", "ts_ns", "metric", "value"),
    "alerts": ("alert_id", "job", "kind", "status", "severity", "ranks", "step", "opened_ns", "updated_ns",
               "resolved_ns", "version", "summary", "lost_rank_seconds", "body"),
    "alert_events": ("alert_id", "job", "kind", "status", "version", "updated_ns", "body"),
    "deadletters": ("ts_ns", "source_topic", "partition", "offset", "stage", "reason", "detail", "payload_b64"),
    "reports": ("job", "window_id", "created_ns", "body"),
    "flight_records": ("job", "rank", "ts_ns", "request_id", "reason", "host", "pid", "steps", "stacks"),
    "trace_events": ("job", "window_id", "rank", "category", "name", "start_ns", "dur_ns", "device", "stream", "step",
                     "bytes", "attrs"),
    "function_summaries": ("job", "window_id", "rank", "category", "name", "count", "total_ns", "median_ns",
                           "p95_ns", "max_ns", "exclusive_ns", "window_ns"),
    "trace_windows": ("job", "window_id", "rank", "status", "first_step", "last_step", "start_ns", "end_ns", "events",
                      "truncated", "updated_ns"),
}
# Insert order: facts first, then the upserts that summarise them.
TABLE_ORDER = (*TABLE_COLUMNS, "ranks", "jobs")


class InvalidMessage(Exception):
    """A message the sink cannot store. ``reason`` is the short code written to the dead letter."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class RetryPolicy:
    """Back-off between write attempts of the same batch: ``initial_s`` doubling up to ``max_s``."""

    initial_s: float = 0.25
    max_s: float = 8.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"RetryPolicy needs 0 < initial_s <= max_s, got {self.initial_s}, {self.max_s}")

    def delay(self, attempt: int) -> float:
        return min(self.max_s, self.initial_s * 2 ** max(0, attempt - 1))


# --------------------------------------------------------------------------------------------
# Row conversion (pure functions; raise InvalidMessage)
# --------------------------------------------------------------------------------------------

def _int(value: Any, name: str, bounds: tuple[int, int] = _I64) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidMessage("bad_body", f"{name} is {type(value).__name__}, expected int")
    if not bounds[0] <= value <= bounds[1]:
        raise InvalidMessage("bad_body", f"{name}={value} out of range {bounds}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidMessage("bad_body", f"{name} is {type(value).__name__}, expected number")
    return float(value)


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise InvalidMessage("bad_body", f"{name} is {type(value).__name__}, expected str")
    return value


def _check_range(values: list[int], name: str, bounds: tuple[int, int] = _I64) -> None:
    if values and (min(values) < bounds[0] or max(values) > bounds[1]):
        raise InvalidMessage("bad_body", f"{name} holds values out of range {bounds}")


class Columns:
    """Column buffers of one table: ``{column: [values]}`` plus the row count.

    Single rows (:meth:`add_row`, :meth:`add_tuple`, :meth:`add_tuples`) are buffered as tuples in
    column order and transposed into the column lists (at C speed) when :attr:`data` is read;
    :meth:`extend` appends whole columns. Row order is kept across both.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        self._data: dict[str, list[Any]] = {n: [] for n in self.names}
        self._buf: list[tuple[Any, ...]] = []
        self.rows = 0

    @property
    def data(self) -> dict[str, list[Any]]:
        buf = self._buf
        if buf:
            for col, values in zip(self._data.values(), zip(*buf, strict=True), strict=True):
                col.extend(values)
            buf.clear()
        return self._data

    def add_row(self, **values: Any) -> None:
        self._buf.append(tuple([values[n] for n in self.names]))
        self.rows += 1

    def add_tuple(self, row: tuple[Any, ...]) -> None:
        """Append one row given as a tuple in column order."""
        self._buf.append(row)
        self.rows += 1

    def add_tuples(self, rows: list[tuple[Any, ...]]) -> None:
        self._buf.extend(rows)
        self.rows += len(rows)

    def extend(self, n: int, **columns: Any) -> None:
        """Append ``n`` rows; each value is a list of ``n`` values or a scalar repeated ``n`` times."""
        for name, col in self.data.items():
            v = columns[name]
            col.extend(v if isinstance(v, list) else [v] * n)
        self.rows += n


def steps_columns(env: Envelope, out: Columns) -> int:
    """Append the step records of a ``steps`` envelope. Returns the highest step (-1 if none)."""
    b = env.body
    steps, starts, ends, comms = b["step"], b["start_ns"], b["end_ns"], b["comm_ns"]
    n = len(steps)
    if not n:
        return -1
    if n == 1:   # the usual v2 beat: one record; decode() checked the types, only the ranges are left
        st, a, e, c = steps[0], starts[0], ends[0], comms[0]
        d = e - a
        if (_LO <= st <= _HI and _LO <= a <= _HI and _LO <= e <= _HI and _LO <= c <= _HI
                and _LO <= d <= _HI):
            out.add_tuple((env.job, env.rank, st, a, e, d, c, d - c if d > c else 0, env.host, env.pid, env.seq))
            return st
    for name, col in (("step", steps), ("start_ns", starts), ("end_ns", ends), ("comm_ns", comms)):
        _check_range(col, f"steps.{name}")
    durations = [e - s for s, e in zip(starts, ends, strict=True)]
    _check_range(durations, "steps.end_ns-start_ns")
    busy = [d - c if d > c else 0 for d, c in zip(durations, comms, strict=True)]
    out.extend(n, job=env.job, rank=env.rank, step=steps, start_ns=starts, end_ns=ends, duration_ns=durations,
               comm_ns=comms, busy_ns=busy, host=env.host, pid=env.pid, seq=env.seq)
    return max(steps)


def heartbeat_row(env: Envelope) -> dict[str, Any]:
    b = env.body
    stacks = b["stacks"]
    return {"job": env.job, "rank": env.rank, "ts_ns": env.sent_ns, "step": _int(b["step"], "heartbeat.step"),
            "since_step_s": _float(b["since_step_s"], "heartbeat.since_step_s"),
            "dropped": _int(b["dropped"], "heartbeat.dropped"), "host": env.host, "pid": env.pid,
            "seq": env.seq, "stacks": "" if stacks is None else json.dumps(stacks, separators=(",", ":"))}


def flight_row(env: Envelope) -> dict[str, Any]:
    b = env.body
    steps = [_int_list(r, "flight.steps[]", len(r) if isinstance(r, list) else -1) for r in b["steps"]]
    stacks = b["stacks"]
    return {"job": env.job, "rank": env.rank, "ts_ns": env.sent_ns, "request_id": str(b.get("request_id", "")),
            "reason": b["reason"], "host": env.host, "pid": env.pid, "steps": json.dumps(steps, separators=(",", ":")),
            "stacks": "" if stacks is None else json.dumps(stacks, separators=(",", ":"))}


STATS_FIELDS: dict[str, Callable[[Any, str], Any]] = {
    "rank": lambda v, n: _int(v, n, _I32), "ts_ns": _int, "step": _int,
    "window_steps": lambda v, n: _int(v, n, _I32), "median_step_ns": _int, "p95_step_ns": _int,
    "median_busy_ns": _int, "median_comm_ns": _int, "busy_z": _float, "state": _str,
}


def stats_tuples(env: Envelope) -> list[tuple[Any, ...]]:
    """The ``worker_stats`` rows of a ``stats`` message as tuples in column order. Raises
    InvalidMessage (via :func:`stats_rows`) exactly as that does; the whole message or nothing."""
    job = env.job
    rows: list[tuple[Any, ...]] = []
    for entry in env.body["ranks"]:
        if type(entry) is not dict:
            break
        try:
            r, ts, st, ws = entry["rank"], entry["ts_ns"], entry["step"], entry["window_steps"]
            med, p95, mb, mc = entry["median_step_ns"], entry["p95_step_ns"], entry["median_busy_ns"], entry["median_comm_ns"]
            bz, state = entry["busy_z"], entry["state"]
        except KeyError:
            break
        tz = type(bz)
        if not (type(r) is int and _LO32 <= r <= _HI32 and type(ts) is int and _LO <= ts <= _HI
                and type(st) is int and _LO <= st <= _HI and type(ws) is int and _LO32 <= ws <= _HI32
                and type(med) is int and _LO <= med <= _HI and type(p95) is int and _LO <= p95 <= _HI
                and type(mb) is int and _LO <= mb <= _HI and type(mc) is int and _LO <= mc <= _HI
                and (tz is float or tz is int) and type(state) is str):
            break
        rows.append((job, r, ts, st, ws, med, p95, mb, mc, float(bz), state))
    else:
        return rows
    names = TABLE_COLUMNS["worker_stats"]
    return [tuple([row[c] for c in names]) for row in stats_rows(env)]


def stats_rows(env: Envelope) -> list[dict[str, Any]]:
    rows = []
    for i, entry in enumerate(env.body["ranks"]):
        if not isinstance(entry, dict):
            raise InvalidMessage("bad_body", f"stats.ranks[{i}] is {type(entry).__name__}")
        row: dict[str, Any] = {"job": env.job}
        for name, conv in STATS_FIELDS.items():
            if name not in entry:
                raise InvalidMessage("bad_body", f"stats.ranks[{i}].{name} missing")
            row[name] = conv(entry[name], f"stats.ranks[{i}].{name}")
        rows.append(row)
    return rows


def hw_columns(env: Envelope, out: Columns) -> None:
    """Columnar samples -> long format, one row per (sample, metric); None values are skipped."""
    rows = _hw_rows(env)
    if rows is None:   # something the fast path does not take: the checked path stores or rejects it
        _hw_columns_checked(env, out)
    else:
        out.add_tuples(rows)


def _hw_rows(env: Envelope) -> list[tuple[Any, ...]] | None:
    """The ``hw_samples`` rows of a well-formed ``hw`` message, or None if anything needs a closer look
    (:func:`_hw_columns_checked` then gives the exact rows or the exact error). Appends nothing."""
    b = env.body
    ts, devices, metrics = b["ts_ns"], b["device"], b["metrics"]
    n = len(ts)
    if len(devices) != n:
        return None
    for t in ts:
        if type(t) is not int or not _LO <= t <= _HI:
            return None
    for d in devices:
        if type(d) is not int or not _LO32 <= d <= _HI32:
            return None
    job, rank, host = env.job, env.rank, env.host
    rows: list[tuple[Any, ...]] = []
    append = rows.append
    for name, values in metrics.items():
        if type(name) is not str or type(values) is not list or len(values) != n:
            return None
        for t, d, v in zip(ts, devices, values, strict=False):   # all n long (checked above)
            tv = type(v)
            if tv is float:
                append((job, rank, host, d, t, name, v))
            elif v is None:
                continue
            elif tv is int:
                append((job, rank, host, d, t, name, float(v)))
            else:
                return None
    return rows


def _hw_columns_checked(env: Envelope, out: Columns) -> None:
    b = env.body
    ts, devices, metrics = b["ts_ns"], b["device"], b["metrics"]
    n = len(ts)
    if len(devices) != n:
        raise InvalidMessage("bad_body", f"hw.device has {len(devices)} values, ts_ns has {n}")
    ts = [_int(t, "hw.ts_ns") for t in ts]
    devices = [_int(d, "hw.device", _I32) for d in devices]
    for name, values in metrics.items():
        if not isinstance(name, str) or not isinstance(values, list) or len(values) != n:
            raise InvalidMessage("bad_body", f"hw.metrics[{name!r}] must be a list of {n} values")
        for t, d, v in zip(ts, devices, values, strict=True):
            if v is not None:
                out.add_row(job=env.job, rank=env.rank, host=env.host, device=d, ts_ns=t, metric=name,
                            value=_float(v, f"hw.metrics[{name!r}]"))


TRACE_INT_COLUMNS = ("category", "name", "start_delta_ns", "dur_ns", "device", "stream", "step", "bytes", "path")
_TRACE_I32 = frozenset({"device", "stream"})


def _int_list(values: Any, name: str, n: int, bounds: tuple[int, int] = _I64) -> list[int]:
    if not isinstance(values, list) or len(values) != n:
        raise InvalidMessage("bad_body", f"{name} must be a list of {n} values")
    if not all(type(v) is int for v in values):
        raise InvalidMessage("bad_body", f"{name} holds a non-integer")
    _check_range(values, name, bounds)
    return values


def _str_list(values: Any, name: str) -> list[str]:
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise InvalidMessage("bad_body", f"{name} must be a list of strings")
    return values


def _attr_map(a: Any, name: str) -> dict[str, str]:
    if a is None:
        return {}
    if not isinstance(a, dict):
        raise InvalidMessage("bad_body", f"{name} is {type(a).__name__}, expected map or nil")
    return {str(k): v if isinstance(v, str) else json.dumps(v, separators=(",", ":")) for k, v in a.items()}


def _trace_attrs(b: dict[str, Any], n: int) -> list[dict[str, str]]:
    """Per-row attrs maps: ``[[row, map], ...]`` (packed chunks) or a list of n maps/nils (list form)."""
    attrs_in = b["events"].get("attrs", [])
    if not isinstance(attrs_in, list):
        raise InvalidMessage("bad_body", "trace.events.attrs must be a list")
    if "column_types" not in b:
        if len(attrs_in) != n:
            raise InvalidMessage("bad_body", f"trace.events.attrs must be a list of {n} values")
        return [_attr_map(a, "trace.events.attrs[]") for a in attrs_in]
    out: list[dict[str, str]] = [{} for _ in range(n)]
    for item in attrs_in:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int and 0 <= item[0] < n):
            raise InvalidMessage("bad_body", "trace.events.attrs entries must be [row, map] with a row in the chunk")
        out[item[0]] = _attr_map(item[1], "trace.events.attrs[]")
    return out


def trace_columns(env: Envelope, out: Columns) -> int:
    """A ``trace`` chunk (producers/trace_events.py ``chunk``) -> ``trace_events`` rows. Returns the row count.

    Each chunk is self-contained: its own ``categories``, ``names``, ``paths`` and ``tids`` tables.
    Integer columns are packed bytes typed by ``column_types`` (rankscope/packed.py), or int lists.
    Times: ``start_ns = t0_ns + cumulative sum of start_delta_ns``. Names: ``names[name]``, except python
    events, named by their call path ``"root;...;leaf"`` resolved through ``paths`` ([parent, name]).
    ``attrs`` maps become ``Map(String, String)`` (non-string values as compact JSON). The chunk is
    validated whole before any row is appended, so a bad chunk adds nothing.
    """
    b = env.body
    window_id = _str(b["window_id"], "trace.window_id")
    ev = b["events"]
    cats = _str_list(b.get("categories"), "trace.categories")
    names = _str_list(b.get("names"), "trace.names")
    paths = b.get("paths", [])
    if not isinstance(paths, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p) for p in paths):
        raise InvalidMessage("bad_body", "trace.paths must be a list of [parent, name] pairs")
    try:
        n, cols = unpack_int_columns(ev, b.get("column_types"), TRACE_INT_COLUMNS)
    except ValueError as e:
        raise InvalidMessage("bad_body", f"trace.events.{e}") from None
    if "count" in b and b["count"] != n:
        raise InvalidMessage("bad_body", f"trace.count is {b['count']!r}, the columns hold {n} events")
    if not n:
        return 0
    for c in _TRACE_I32:
        if cols[c].min() < _I32[0] or cols[c].max() > _I32[1]:
            raise InvalidMessage("bad_body", f"trace.events.{c} holds values out of range {_I32}")
    attrs = _trace_attrs(b, n)
    if cols["category"].min() < 0 or cols["category"].max() >= len(cats):
        raise InvalidMessage("bad_body", "trace.events.category outside the categories table")
    if cols["name"].min() < 0 or cols["name"].max() >= len(names):
        raise InvalidMessage("bad_body", "trace.events.name outside the names table")
    if cols["path"].min() < -1 or cols["path"].max() >= len(paths):
        raise InvalidMessage("bad_body", "trace.events.path outside the paths table")
    path_list = cols["path"].tolist()
    # Call paths: resolve each used id once (parents first, iteratively; a cycle is an error).
    resolved: dict[int, str] = {}
    for pid in set(path_list) - {-1}:
        chain: list[int] = []
        p = pid
        while p >= 0 and p not in resolved:
            if p >= len(paths) or len(chain) > len(paths) or not 0 <= paths[p][1] < len(names):
                raise InvalidMessage("bad_body", f"trace.paths entry {p} is malformed")
            chain.append(p)
            p = paths[p][0]
        prefix = resolved.get(p)
        for q in reversed(chain):
            leaf = names[paths[q][1]]
            prefix = leaf if prefix is None else f"{prefix};{leaf}"
            resolved[q] = prefix
    t0 = _int(b.get("t0_ns"), "trace.t0_ns")
    deltas = cols["start_delta_ns"]
    if abs(t0) + max(abs(int(deltas.min())), abs(int(deltas.max()))) * n >= _I64[1]:      # the cumulative sum could wrap
        starts = list(itertools.accumulate(deltas.tolist(), initial=t0))[1:]
        _check_range(starts, "trace.start_ns")
    else:
        starts = (t0 + np.cumsum(deltas)).tolist()
    cat_names = [cats[c] for c in cols["category"].tolist()]
    row_names = [resolved[p] if p >= 0 else names[i] for i, p in zip(cols["name"].tolist(), path_list, strict=True)]
    out.extend(n, job=env.job, window_id=window_id, rank=env.rank, category=cat_names, name=row_names,
               start_ns=starts, dur_ns=cols["dur_ns"].tolist(), device=cols["device"].tolist(),
               stream=cols["stream"].tolist(), step=cols["step"].tolist(), bytes=cols["bytes"].tolist(), attrs=attrs)
    return n


SUMMARY_INT_COLUMNS = ("count", "total_ns", "median_ns", "p95_ns", "max_ns", "exclusive_ns")


def summary_columns(env: Envelope, out: Columns) -> dict[str, Any]:
    """A ``summary`` message -> ``function_summaries`` rows (appended to ``out``) and the window's
    ``trace_windows`` row (returned). ``events`` in that row is ``events_sent``: the number of
    ``trace_events`` rows the window should have; ``truncated`` says whether the rank left some out."""
    b = env.body
    window_id = _str(b["window_id"], "summary.window_id")
    try:
        f = expand_call_paths(b["functions"])
    except ValueError as e:
        raise InvalidMessage("bad_body", f"summary.functions: {e}") from None
    cats = _str_list(f.get("category"), "summary.functions.category")
    n = len(cats)
    fnames = _str_list(f.get("name"), "summary.functions.name")
    if len(fnames) != n:
        raise InvalidMessage("bad_body", f"summary.functions.name has {len(fnames)} values, category has {n}")
    cols = {c: _int_list(f.get(c), f"summary.functions.{c}", n) for c in SUMMARY_INT_COLUMNS}
    start_ns = _int(b.get("start_ns"), "summary.start_ns")
    end_ns = _int(b.get("end_ns"), "summary.end_ns")
    window_ns = _int(f.get("window_ns", end_ns - start_ns), "summary.functions.window_ns")
    truncated = b.get("truncated", False)
    if not isinstance(truncated, bool):
        raise InvalidMessage("bad_body", f"summary.truncated is {type(truncated).__name__}, expected bool")
    window = {"job": env.job, "window_id": window_id, "rank": env.rank,
              "status": _str(b.get("status", "done"), "summary.status"),
              "first_step": _int(b.get("first_step", -1), "summary.first_step"),
              "last_step": _int(b.get("last_step", -1), "summary.last_step"), "start_ns": start_ns, "end_ns": end_ns,
              "events": _int(b.get("events_sent", b.get("events_total", 0)), "summary.events_sent"),
              "truncated": int(truncated), "updated_ns": env.sent_ns}
    if n:
        out.extend(n, job=env.job, window_id=window_id, rank=env.rank, category=cats, name=fnames,
                   window_ns=window_ns, **cols)
    return window


def report_row(value: bytes | None) -> dict[str, Any]:
    """A diagnosis report (JSON from the processors) -> one ``reports`` row."""
    try:
        rep = json.loads(value or b"")
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidMessage("bad_report", f"not JSON: {e}") from None
    if not isinstance(rep, dict) or rep.get("schema_version") != 1:
        raise InvalidMessage("bad_report", f"unknown report schema_version {rep.get('schema_version') if isinstance(rep, dict) else None!r}")
    return {"job": _str(rep.get("job"), "report.job"), "window_id": _str(rep.get("window_id"), "report.window_id"),
            "created_ns": int(rep.get("created_ns") or time.time_ns()), "body": (value or b"").decode()}


def alert_rows(alert: Alert) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``alerts`` row (latest state, body = the whole JSON) and the ``alert_events`` row."""
    if not isinstance(alert.ranks, list):
        raise InvalidMessage("bad_alert", "ranks is not a list")
    body = alert.to_json().decode()
    try:
        row = {"alert_id": _str(alert.alert_id, "alert_id"), "job": _str(alert.job, "job"), "kind": alert.kind,
               "status": alert.status, "severity": _str(alert.severity, "severity"),
               "ranks": [_int(r, "ranks[]", _I32) for r in alert.ranks], "step": _int(alert.step, "step"),
               "opened_ns": _int(alert.opened_ns, "opened_ns"), "updated_ns": _int(alert.updated_ns, "updated_ns"),
               "resolved_ns": _int(alert.resolved_ns, "resolved_ns"), "version": _int(alert.version, "version", _U32),
               "summary": _str(alert.summary, "summary"),
               "lost_rank_seconds": _float(alert.lost_rank_seconds, "lost_rank_seconds"), "body": body}
    except InvalidMessage as e:
        raise InvalidMessage("bad_alert", e.detail) from None
    event = {k: row[k] for k in TABLE_COLUMNS["alert_events"]}
    return row, event


def deadletter_row(dl: DeadLetter) -> dict[str, Any]:
    try:
        return {"ts_ns": _int(dl.ts_ns, "ts_ns"), "source_topic": _str(dl.source_topic, "source_topic"),
                "partition": _int(dl.partition, "partition", _I32), "offset": _int(dl.offset, "offset"),
                "stage": _str(dl.stage, "stage"), "reason": _str(dl.reason, "reason"),
                "detail": _str(dl.detail, "detail"), "payload_b64": _str(dl.payload_b64, "payload_b64")}
    except InvalidMessage as e:
        raise InvalidMessage("bad_deadletter", e.detail) from None


# --------------------------------------------------------------------------------------------
# Rank and job state (carried forward so every upsert row is complete)
# --------------------------------------------------------------------------------------------

def _new_rank(job: str, rank: int) -> dict[str, Any]:
    return {"job": job, "rank": rank, "host": "", "pid": 0, "local_rank": -1, "world_size": -1,
            "last_step": -1, "last_seen_ns": 0, "exit_reason": "", "exit_detail": ""}


def merge_rank(state: dict[str, Any], upd: dict[str, Any]) -> None:
    """Merge a partial observation ``upd`` (must hold ``last_seen_ns``) into ``state`` in place.

    Rules: ``last_seen_ns`` and ``last_step`` take the maximum; host/pid/local_rank/world_size take
    the newer known value (unknown = ''/0/-1); an exit reason is kept once seen. A newer observation
    from another pid is a restarted rank: its step and (empty) exit reason replace the old ones.
    An older observation from another pid only fills unknown host/world_size/local_rank.
    """
    seen = upd["last_seen_ns"]
    newer = seen >= state["last_seen_ns"]
    other_pid = bool(upd.get("pid")) and bool(state["pid"]) and upd["pid"] != state["pid"]
    if other_pid and not newer:
        for k, unknown in (("host", ""), ("world_size", -1), ("local_rank", -1)):
            if state[k] == unknown and upd.get(k, unknown) != unknown:
                state[k] = upd[k]
        return
    if other_pid:
        state["last_step"] = upd.get("last_step", -1)
        state["exit_reason"] = upd.get("exit_reason", "")
        state["exit_detail"] = upd.get("exit_detail", "")
    else:
        state["last_step"] = max(state["last_step"], upd.get("last_step", -1))
        if upd.get("exit_reason"):
            state["exit_reason"] = upd["exit_reason"]
            state["exit_detail"] = upd.get("exit_detail", "")
    for k, unknown in (("host", ""), ("pid", 0), ("world_size", -1), ("local_rank", -1)):
        v = upd.get(k, unknown)
        if v != unknown and (newer or state[k] == unknown):
            state[k] = v
    state["last_seen_ns"] = max(state["last_seen_ns"], seen)


def merge_job(state: dict[str, Any], upd: dict[str, Any]) -> None:
    if upd.get("world_size", -1) > 0 and (upd["last_seen_ns"] >= state["last_seen_ns"] or state["world_size"] <= 0):
        state["world_size"] = upd["world_size"]
    firsts = [x for x in (state["first_seen_ns"], upd.get("first_seen_ns", upd["last_seen_ns"])) if x > 0]
    state["first_seen_ns"] = min(firsts) if firsts else 0
    state["last_seen_ns"] = max(state["last_seen_ns"], upd["last_seen_ns"])


# --------------------------------------------------------------------------------------------
# The batch
# --------------------------------------------------------------------------------------------

@dataclass
class Batch:
    started_at: float
    tables: dict[str, Columns] = field(default_factory=dict)
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)   # (topic, partition) -> next offset
    messages: int = 0
    rows: int = 0
    dead_letters: int = 0
    ranks: set[tuple[str, int]] = field(default_factory=set)            # dirty (job, rank) keys
    jobs: set[str] = field(default_factory=set)                         # dirty jobs
    done: set[str] = field(default_factory=set)                         # tables already written
    attempts: int = 0

    def table(self, name: str) -> Columns:
        cols = self.tables.get(name)
        if cols is None:
            cols = self.tables[name] = Columns(TABLE_COLUMNS[name])
        return cols


# --------------------------------------------------------------------------------------------
# The sink
# --------------------------------------------------------------------------------------------

def consumer_config(settings: Settings) -> dict[str, Any]:
    return {
        **client_conf(settings, fatal=True),
        "group.id": settings.sink_group,
        "client.id": "rankscope-sink",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": 10000,
        "heartbeat.interval.ms": 2000,
        "max.poll.interval.ms": 300000,
        "topic.metadata.refresh.interval.ms": 10000,  # pick up topics created after start-up
        "logger": _client_log,
    }


def producer_config(settings: Settings) -> dict[str, Any]:
    return {**client_conf(settings), "client.id": "rankscope-sink-dlq", "acks": "all",
            "enable.idempotence": True, "linger.ms": 20, "logger": _client_log}


class Sink:
    """Consumes the rankscope topics into the store. One thread drives it (``run`` or ``poll_once``).

    ``consumer``/``producer`` default to confluent-kafka clients built from ``settings``; tests may pass
    objects with the same methods. ``stats()`` may be called from any thread.
    """

    def __init__(self, settings: Settings, store: Store, clock: Clock = SYSTEM_CLOCK, *,
                 consumer: Any = None, producer: Any = None, counter: DeadLetterCounter | None = None,
                 retry: RetryPolicy | None = None, max_poll_messages: int = 1000) -> None:
        self.settings = settings
        self.store = store
        self.clock = clock
        self.retry = retry or RetryPolicy()
        self.dead_letters = counter or DeadLetterCounter()
        self.metrics = process_metrics()
        self.max_poll_messages = max_poll_messages
        self.topics = {t: t.name_for(settings) for t in SINK_TOPICS}
        self._kind_by_name = {name: t for t, name in self.topics.items()}
        self._deadletter_topic = Topic.DEADLETTER.name_for(settings)
        if consumer is None:
            from confluent_kafka import Consumer

            consumer = Consumer(consumer_config(settings))
        if producer is None:
            from confluent_kafka import Producer

            producer = Producer(producer_config(settings))
        self._consumer = consumer
        self._producer = producer
        self._consumer.subscribe(list(self.topics.values()), on_assign=self._on_assign,
                                 on_revoke=self._on_revoke)
        self._batch: Batch | None = None      # open batch, still taking messages
        self._pending: Batch | None = None    # closed batch whose write failed, waiting to retry
        self._retry_at = 0.0
        self._paused = False
        self._ranks: dict[tuple[str, int], dict[str, Any]] = {}
        self._jobs: dict[str, dict[str, Any]] = {}
        self._hydrated: set[str] = set()
        self._closed = False
        self._lock = threading.Lock()
        self._rows: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._last_commit: dict[str, Any] = {}
        self._assignment: list[str] = []
        self._dlq_failures = 0

    # Public interface ---------------------------------------------------------------------------
    def run(self, stop: threading.Event, poll_timeout_s: float = 0.1) -> None:
        """Poll until ``stop`` is set, then write the open batch (one attempt) and close. Blocks."""
        try:
            while not stop.is_set():
                self.poll_once(poll_timeout_s)
        finally:
            self.close()

    def poll_once(self, timeout_s: float = 0.1) -> int:
        """One step: consume up to ``max_poll_messages`` (waiting at most ``timeout_s``), add them to
        the batch, and write the batch when it is full or old enough. While a failed batch waits for
        its retry, only keep the consumer alive. Returns the number of messages taken.

        Raises KafkaException on fatal consumer errors; store errors are retried, never raised.
        """
        if self._pending is not None:
            if self.clock.monotonic() < self._retry_at:
                self._keep_alive(timeout_s)
                return 0
            self._write(self._pending)
            return 0
        msgs = self._consumer.consume(num_messages=self.max_poll_messages, timeout=timeout_s)
        self.metrics.consumed(msgs, self._consumer, self.clock.wall_ns())
        taken = 0
        for i, msg in enumerate(msgs):
            if self._pending is not None:
                # A full batch failed to write mid-call: rewind the rest so that nothing is skipped.
                self._rewind(msgs[i:])
                break
            if self._handle_error(msg):
                continue
            self._add(msg)
            taken += 1
            if self._batch is not None and self._batch.rows >= self.settings.sink_batch_rows:
                full, self._batch = self._batch, None
                self._write(full)
        batch = self._batch
        if batch is not None and (batch.rows >= self.settings.sink_batch_rows or
                                  self.clock.monotonic() - batch.started_at >= self.settings.sink_batch_s):
            self._batch = None
            self._write(batch)
        return taken

    def stats(self) -> dict[str, Any]:
        """Counters: rows written per table, messages, batches, dead letters, store errors, the last
        commit and the current assignment. Safe from any thread (unlike the consumer itself)."""
        with self._lock:
            return {"rows": dict(self._rows), "counts": dict(self._counts),
                    "batches": self._counts["batches"], "messages": self._counts["messages"],
                    "dead_letters": self.dead_letters.total(), "dead_letter_reasons": self.dead_letters.snapshot(),
                    "store_errors": self._counts["store_errors"], "pending_retry": self._pending is not None,
                    "last_commit": dict(self._last_commit), "assignment": list(self._assignment)}

    def close(self) -> None:
        """Write the open batch (one attempt; uncommitted if it fails), flush dead letters and leave the
        group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        batch = self._pending or self._batch
        self._pending = self._batch = None
        if batch is not None and batch.messages:
            self._write(batch, once=True)
        try:
            left = self._producer.flush(self.settings.flush_timeout_s)
            if left:
                log.error("sink: %d dead letters not delivered on close", left)
            if hasattr(self._producer, "close"):
                self._producer.close()
        except Exception:
            log.exception("sink: flushing dead letters on close failed")
        try:
            self._consumer.close()
        except Exception:
            log.exception("sink: closing the consumer failed")

    # Consuming ----------------------------------------------------------------------------------
    def _handle_error(self, msg: Any) -> bool:
        err = msg.error()
        if err is None:
            return False
        from confluent_kafka import KafkaError, KafkaException

        if err.code() == KafkaError._PARTITION_EOF:
            return True
        if err.fatal():
            raise KafkaException(err)
        self._count("consumer_errors")
        log.warning("sink: consumer error: %s", err)
        return True

    def _add(self, msg: Any) -> None:
        if self._batch is None:
            self._batch = Batch(started_at=self.clock.monotonic())
        batch = self._batch
        topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
        batch.messages += 1
        batch.offsets[(topic, partition)] = max(batch.offsets.get((topic, partition), 0), offset + 1)
        value = msg.value()
        try:
            self._convert(self._kind_by_name.get(topic), value, batch)
        except InvalidMessage as e:
            self._dead_letter(topic, partition, offset, e.reason, e.detail, value)
            batch.dead_letters += 1

    def _convert(self, topic: Topic | None, value: bytes | None, batch: Batch) -> None:
        if topic is Topic.ALERTS:
            try:
                alert = Alert.from_json(value or b"")
            except Exception as e:
                raise InvalidMessage("bad_alert", str(e)) from None
            row, event = alert_rows(alert)
            self._add_row(batch, "alerts", row)
            self._add_row(batch, "alert_events", event)
            return
        if topic is Topic.REPORTS:
            self._add_row(batch, "reports", report_row(value))
            return
        if topic is Topic.DEADLETTER:
            try:
                dl = DeadLetter.from_json(value or b"")
            except Exception as e:
                raise InvalidMessage("bad_deadletter", f"{type(e).__name__}: {e}") from None
            self._add_row(batch, "deadletters", deadletter_row(dl))
            return
        try:
            env = decode(value)
        except WireError as e:
            raise InvalidMessage(e.reason, e.detail) from None
        # decode() checked the envelope's types; only the column ranges are left.
        if not (_LO32 <= env.rank <= _HI32 and _LO32 <= env.pid <= _HI32 and _LO <= env.sent_ns <= _HI
                and _LO <= env.seq <= _HI):
            _int(env.rank, "rank", _I32)
            _int(env.pid, "pid", _I32)
            _int(env.sent_ns, "sent_ns")
            _int(env.seq, "seq")
        kind = env.kind
        if kind == "beat":
            if not self._store_beat(env, batch):
                for part in split_beat(env):
                    self._store(part, batch)
        elif kind == "hw":
            rows = _hw_rows(env)
            if rows is None:
                self._store(env, batch)
            else:
                batch.table("hw_samples").add_tuples(rows)
                batch.rows += len(rows)
        elif kind == "stats":
            rows = stats_tuples(env)
            batch.table("worker_stats").add_tuples(rows)
            batch.rows += len(rows)
        else:
            self._store(env, batch)

    def _store_beat(self, env: Envelope, batch: Batch) -> bool:
        """A well-formed v2 beat: its step rows, its heartbeat row and one observation of the rank, the
        same rows and state as storing :func:`split_beat`'s pair. Returns False, having added nothing,
        when anything needs a closer look (the split pair's checked path then stores or rejects it)."""
        b = env.body
        step, since, dropped, ws, lr = b["hb_step"], b["since_step_s"], b["dropped"], b["world_size"], b["local_rank"]
        ts = type(since)
        if not (type(step) is int and _LO <= step <= _HI and (ts is float or ts is int) and type(dropped) is int
                and _LO <= dropped <= _HI and type(ws) is int and _LO32 <= ws <= _HI32 and type(lr) is int
                and _LO32 <= lr <= _HI32):
            return False
        steps = b["step"]
        job, rank, host, pid, seq, sent = env.job, env.rank, env.host, env.pid, env.seq, env.sent_ns
        last = -1
        if len(steps) == 1:
            st, a, e, c = steps[0], b["start_ns"][0], b["end_ns"][0], b["comm_ns"][0]
            d = e - a
            if not (_LO <= st <= _HI and _LO <= a <= _HI and _LO <= e <= _HI and _LO <= c <= _HI and _LO <= d <= _HI):
                return False
            batch.table("steps").add_tuple((job, rank, st, a, e, d, c, d - c if d > c else 0, host, pid, seq))
            batch.rows += 1
            last = st
        elif steps:
            cols = batch.table("steps")
            before = cols.rows
            try:
                last = steps_columns(Envelope(kind="steps", job=job, rank=rank, host=host, pid=pid, seq=seq,
                                              sent_ns=sent, body=b, v=env.v), cols)
            except InvalidMessage:
                return False   # steps_columns validates before it appends
            batch.rows += cols.rows - before
        stacks = b["stacks"]
        batch.table("heartbeats").add_tuple(
            (job, rank, sent, step, float(since), dropped, host, pid, seq,
             "" if stacks is None else json.dumps(stacks, separators=(",", ":"))))
        batch.rows += 1
        self._observe_beat(batch, env, max(last, step), ws, lr)
        return True

    def _observe_beat(self, batch: Batch, env: Envelope, last_step: int, world_size: int, local_rank: int) -> None:
        """One observation for a beat's two parts: the same state as :meth:`_observe` of the steps part
        (``last_step`` = the highest step) and then of the heartbeat part."""
        key = (env.job, env.rank)
        state = self._ranks.get(key)
        seen, pid = env.sent_ns, env.pid
        if state is not None and state["pid"] == pid and seen >= state["last_seen_ns"]:
            # merge_rank's common case: the same process, a newer observation, no exit.
            if last_step > state["last_step"]:
                state["last_step"] = last_step
            if env.host != "":
                state["host"] = env.host
            if world_size != -1:
                state["world_size"] = world_size
            if local_rank != -1:
                state["local_rank"] = local_rank
            state["last_seen_ns"] = seen
            job = self._jobs.get(env.job)
            if job is not None and 0 < job["first_seen_ns"] <= seen and seen >= job["last_seen_ns"]:
                # merge_job's common case
                if world_size > 0:
                    job["world_size"] = world_size
                job["last_seen_ns"] = seen
                batch.ranks.add(key)
                batch.jobs.add(env.job)
                return
            merge_job(self._job(env.job), {"world_size": world_size, "last_seen_ns": seen})
            batch.ranks.add(key)
            batch.jobs.add(env.job)
            return
        self._observe(batch, env, {"last_step": last_step, "world_size": world_size, "local_rank": local_rank})

    def _job(self, job_id: str) -> dict[str, Any]:
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = {"job": job_id, "world_size": -1, "first_seen_ns": 0, "last_seen_ns": 0}
        return job

    def _store(self, env: Envelope, batch: Batch) -> None:
        kind = env.kind
        if kind not in STORED_KINDS:
            self._count(f"skipped:{kind}")
            return
        if kind == "steps":
            cols = batch.table("steps")
            before = cols.rows
            last = steps_columns(env, cols)
            batch.rows += cols.rows - before
            if last >= 0:
                self._observe(batch, env, {"last_step": last})
        elif kind == "heartbeat":
            row = heartbeat_row(env)
            b = env.body
            self._add_row(batch, "heartbeats", row)
            self._observe(batch, env, {"last_step": row["step"],
                                       "world_size": _int(b["world_size"], "heartbeat.world_size", _I32),
                                       "local_rank": _int(b["local_rank"], "heartbeat.local_rank", _I32)})
        elif kind == "exit":
            b = env.body
            self._observe(batch, env, {"last_step": _int(b["step"], "exit.step"), "exit_reason": b["reason"],
                                       "exit_detail": b["detail"]})
        elif kind == "stats":
            rows = stats_tuples(env)
            batch.table("worker_stats").add_tuples(rows)
            batch.rows += len(rows)
        elif kind == "hw":
            cols = batch.table("hw_samples")
            before = cols.rows
            hw_columns(env, cols)
            batch.rows += cols.rows - before
        elif kind == "trace":
            batch.rows += trace_columns(env, batch.table("trace_events"))
        elif kind == "flight":
            self._add_row(batch, "flight_records", flight_row(env))
        elif kind == "summary":
            cols = batch.table("function_summaries")
            before = cols.rows
            window = summary_columns(env, cols)
            batch.rows += cols.rows - before
            self._add_row(batch, "trace_windows", window)

    def _add_row(self, batch: Batch, table: str, row: dict[str, Any]) -> None:
        batch.table(table).add_row(**row)
        batch.rows += 1

    def _observe(self, batch: Batch, env: Envelope, upd: dict[str, Any]) -> None:
        key = (env.job, env.rank)
        state = self._ranks.get(key)
        if state is None:
            state = self._ranks[key] = _new_rank(env.job, env.rank)
        upd = {"host": env.host, "pid": env.pid, "last_seen_ns": env.sent_ns, **upd}
        merge_rank(state, upd)
        job = self._jobs.get(env.job)
        if job is None:
            job = self._jobs[env.job] = {"job": env.job, "world_size": -1, "first_seen_ns": 0, "last_seen_ns": 0}
        merge_job(job, {"world_size": upd.get("world_size", -1), "last_seen_ns": env.sent_ns})
        batch.ranks.add(key)
        batch.jobs.add(env.job)

    def _dead_letter(self, topic: str, partition: int, offset: int, reason: str, detail: str,
                     payload: bytes | None) -> None:
        self.dead_letters.add(STAGE, reason)
        self.metrics.dead_letter(STAGE, reason)
        dl = DeadLetter.make(ts_ns=self.clock.wall_ns(), source_topic=topic, partition=partition, offset=offset,
                             stage=STAGE, reason=reason, detail=detail, payload=payload)
        log.debug("sink: dead letter %s[%d]@%d: %s %s", topic, partition, offset, reason, detail)
        while True:
            try:
                self._producer.produce(self._deadletter_topic, key=topic.encode(), value=dl.to_json(),
                                       on_delivery=self._on_dlq_delivery)
                break
            except BufferError:   # local queue full: serve delivery reports and try again
                self._producer.poll(0.1)
        self._producer.poll(0)

    def _on_dlq_delivery(self, err: Any, msg: Any) -> None:
        if err is not None:
            self._dlq_failures += 1
            log.error("sink: dead letter not delivered: %s", err)

    # Writing ------------------------------------------------------------------------------------
    def _write(self, batch: Batch, once: bool = False) -> bool:
        """Insert every table of ``batch``, then commit its offsets. On failure keep it as pending."""
        batch.attempts += 1
        try:
            self._insert(batch)
            self._flush_dead_letters()
        except StoreError as e:
            self._count("store_errors")
            self.metrics.insert_errors.inc()
            if once:
                log.error("sink: batch of %d messages not written (%s); left uncommitted", batch.messages, e)
                return False
            delay = self.retry.delay(batch.attempts)
            log.error("sink: write attempt %d of a batch of %d rows failed, retrying in %.2fs: %s",
                      batch.attempts, batch.rows, delay, e)
            self._pending = batch
            self._retry_at = self.clock.monotonic() + delay
            self._pause()
            return False
        self._pending = None
        self._resume()
        self._commit(batch)
        return True

    def _insert(self, batch: Batch) -> None:
        if batch.jobs - self._hydrated:
            self._hydrate(sorted(batch.jobs - self._hydrated))
        for table in TABLE_ORDER:
            if table in batch.done:
                continue
            if table == "ranks":
                rows = [self._ranks[k] for k in sorted(batch.ranks)]
                columns = {c: [r[c] for r in rows] for c in RANK_COLUMNS}
            elif table == "jobs":
                rows = [self._jobs[j] for j in sorted(batch.jobs)]
                columns = {c: [r[c] for r in rows] for c in JOB_COLUMNS}
            elif table in batch.tables:
                columns = batch.tables[table].data
            else:
                continue
            t0 = time.perf_counter()
            n = self.store.insert_columns(table, columns)
            self.metrics.inserted(table, n, time.perf_counter() - t0)
            batch.done.add(table)
            with self._lock:
                self._rows[table] += n

    def _hydrate(self, jobs: list[str]) -> None:
        """Merge what the store already knows about these jobs into the in-memory state (once per job)."""
        db = self.store.database
        params = {"jobs": jobs}
        for row in self.store.query_rows(
                f"SELECT {', '.join(RANK_COLUMNS)} FROM {db}.ranks FINAL WHERE job IN {{jobs:Array(String)}}",
                parameters=params):
            stored = dict(zip(RANK_COLUMNS, row, strict=True))
            key = (stored["job"], stored["rank"])
            if key in self._ranks:
                merge_rank(self._ranks[key], stored)
        for row in self.store.query_rows(
                f"SELECT {', '.join(JOB_COLUMNS)} FROM {db}.jobs FINAL WHERE job IN {{jobs:Array(String)}}",
                parameters=params):
            stored = dict(zip(JOB_COLUMNS, row, strict=True))
            if stored["job"] in self._jobs:
                merge_job(self._jobs[stored["job"]], stored)
        self._hydrated.update(jobs)

    def _flush_dead_letters(self) -> None:
        left = self._producer.flush(self.settings.flush_timeout_s)
        if left:
            raise StoreError(f"{left} dead letters not yet delivered to {self._deadletter_topic}")

    def _commit(self, batch: Batch) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        self._count("batches")
        self._count("messages", batch.messages)
        if not batch.offsets:
            return
        offsets = [TopicPartition(t, p, o) for (t, p), o in sorted(batch.offsets.items())]
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as e:
            # The rows are in the store; a later commit covers these offsets, or a re-read re-inserts
            # the same rows (idempotent).
            self._count("commit_errors")
            log.warning("sink: commit failed (rows are written; may be re-read): %s", e)
            return
        with self._lock:
            self._last_commit = {"ts_ns": self.clock.wall_ns(),
                                 "offsets": {f"{t}[{p}]": o for (t, p), o in sorted(batch.offsets.items())}}

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    # Back-pressure and rebalancing ----------------------------------------------------------------
    def _pause(self) -> None:
        if not self._paused:
            self._consumer.pause(self._consumer.assignment())
            self._paused = True

    def _resume(self) -> None:
        if self._paused:
            self._consumer.resume(self._consumer.assignment())
            self._paused = False

    def _keep_alive(self, timeout_s: float) -> None:
        """Serve the group protocol while paused. A message delivered anyway is rewound, not lost."""
        wait = max(0.0, min(timeout_s, self._retry_at - self.clock.monotonic()))
        msg = self._consumer.poll(wait)
        if msg is not None and msg.error() is None:
            from confluent_kafka import TopicPartition

            self._consumer.seek(TopicPartition(msg.topic(), msg.partition(), msg.offset()))

    def _rewind(self, msgs: list[Any]) -> None:
        from confluent_kafka import TopicPartition

        first: dict[tuple[str, int], int] = {}
        for m in msgs:
            if m.error() is None:
                key = (m.topic(), m.partition())
                first[key] = min(first.get(key, m.offset()), m.offset())
        for (topic, partition), offset in first.items():
            self._consumer.seek(TopicPartition(topic, partition, offset))

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        log.info("sink: assigned %s", [(p.topic, p.partition) for p in partitions])
        with self._lock:
            self._assignment = sorted(f"{p.topic}[{p.partition}]" for p in partitions)
        if self._paused and partitions:
            consumer.pause(partitions)

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        log.info("sink: revoked %s", [(p.topic, p.partition) for p in partitions])
        for p in partitions:
            self.metrics.forget_partitions(p.topic, [p.partition])
        with self._lock:
            self._assignment = []
        batch = self._pending or self._batch
        self._pending = self._batch = None
        if batch is not None and batch.messages:
            self._write(batch, once=True)   # dropped uncommitted if it fails; the next owner re-reads it
        self._pending = None
        if self._paused:
            self._paused = False
            try:
                consumer.resume(partitions)
            except Exception:
                pass
