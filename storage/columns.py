"""The store's tables as the sink writes them: their columns, typed column buffers, and the value
checks that keep a bad value out of a column (they raise :class:`InvalidMessage`, which the sink
turns into a dead letter)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rankscope.protocol.errors import WireError

I64 = (-(2**63), 2**63 - 1)
I32 = (-(2**31), 2**31 - 1)
U32 = (0, 2**32 - 1)
LO, HI = I64
LO32, HI32 = I32

RANK_COLUMNS = ("job", "rank", "host", "pid", "local_rank", "world_size", "last_step", "last_seen_ns",
                "exit_reason", "exit_detail")
JOB_COLUMNS = ("job", "world_size", "first_seen_ns", "last_seen_ns")
TABLE_COLUMNS: dict[str, tuple[str, ...]] = {
    "steps": ("job", "rank", "step", "start_ns", "end_ns", "duration_ns", "comm_ns", "busy_ns", "host",
              "pid", "seq"),
    "heartbeats": ("job", "rank", "ts_ns", "step", "since_step_s", "dropped", "host", "pid", "seq", "stacks"),
    "worker_stats": ("job", "rank", "ts_ns", "step", "window_steps", "median_step_ns", "p95_step_ns",
                     "median_busy_ns", "median_comm_ns", "busy_z", "state", "cpu_wait_share"),
    "hw_samples": ("job", "rank", "host", "device", "ts_ns", "metric", "value"),
    "alerts": ("alert_id", "job", "kind", "status", "severity", "ranks", "step", "opened_ns", "updated_ns",
               "resolved_ns", "version", "summary", "lost_rank_seconds", "body"),
    "alert_events": ("alert_id", "job", "kind", "status", "version", "updated_ns", "body"),
    "deadletters": ("ts_ns", "source_topic", "partition", "offset", "stage", "reason", "detail", "payload_b64"),
    "reports": ("job", "window_id", "created_ns", "body"),
    "flight_records": ("job", "rank", "ts_ns", "request_id", "reason", "host", "pid", "steps", "stacks"),
    "fr_dumps": ("job", "rank", "ts_ns", "request_id", "reason", "host", "pid", "truncated", "dump"),
    "profile_samples": ("job", "rank", "host", "pid", "ts_ns", "interval_ns", "role", "path", "samples", "hz"),
    "trace_events": ("job", "window_id", "rank", "category", "name", "start_ns", "dur_ns", "device", "stream", "step",
                     "bytes", "attrs", "correlation", "external_id"),
    "function_summaries": ("job", "window_id", "rank", "category", "name", "count", "total_ns", "median_ns",
                           "p95_ns", "max_ns", "exclusive_ns", "window_ns"),
    "trace_windows": ("job", "window_id", "rank", "status", "first_step", "last_step", "start_ns", "end_ns", "events",
                      "truncated", "updated_ns", "thread_cpu_ns", "thread_runq_ns"),
}
# Tables written as Arrow, with each column's Arrow type ("dict": a dictionary-encoded string, for a
# LowCardinality(String) column). The dictionaries are then built in C: clickhouse-connect's native
# format builds them in Python, ~0.8 µs a row, and a 10,000-rank job's hardware samples make ~220,000
# rows a second. The types also check each value's range.
ARROW_TYPES: dict[str, dict[str, str]] = {
    "hw_samples": {"job": "dict", "rank": "int32", "host": "dict", "device": "int32", "ts_ns": "int64",
                   "metric": "dict", "value": "float64"},
    "steps": {"job": "dict", "rank": "int32", "step": "int64", "start_ns": "int64", "end_ns": "int64",
              "duration_ns": "int64", "comm_ns": "int64", "busy_ns": "int64", "host": "dict", "pid": "int32",
              "seq": "int64"},
    "profile_samples": {"job": "dict", "rank": "int32", "host": "dict", "pid": "int32", "ts_ns": "int64",
                        "interval_ns": "int64", "role": "dict", "path": "dict", "samples": "uint32",
                        "hz": "float32"},
}
# Insert order: facts first, then the upserts that summarise them.
TABLE_ORDER = (*TABLE_COLUMNS, "ranks", "jobs")


class InvalidMessage(WireError):
    """A message the sink cannot store: a :class:`~rankscope.protocol.errors.WireError` found past ``decode``
    (a value out of its column's range, a bad report or alert). ``reason`` is the short code written
    to the dead letter, ``detail`` what was wrong."""


def int_field(value: Any, name: str, bounds: tuple[int, int] = I64) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidMessage("bad_body", f"{name} is {type(value).__name__}, expected int")
    if not bounds[0] <= value <= bounds[1]:
        raise InvalidMessage("bad_body", f"{name}={value} out of range {bounds}")
    return value


def float_field(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidMessage("bad_body", f"{name} is {type(value).__name__}, expected number")
    return float(value)


def str_field(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise InvalidMessage("bad_body", f"{name} is {type(value).__name__}, expected str")
    return value


def check_range(values: list[int], name: str, bounds: tuple[int, int] = I64) -> None:
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
