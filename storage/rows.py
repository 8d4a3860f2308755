"""Messages to rows: pure functions from one decoded message to the rows of the store's tables.

Each validates what :func:`rankscope.protocol.envelope.decode` leaves unchecked (value ranges, the shapes inside
a body) and raises :class:`~rankscope.storage.columns.InvalidMessage` before it appends anything. No Kafka
and no store here (storage/convert.py applies them to a batch, storage/sink.py consumes).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from itertools import chain, compress, repeat
from operator import is_not
from typing import Any

from rankscope.protocol import profile
from rankscope.protocol.alerts import Alert
from rankscope.protocol.deadletter import DeadLetter
from rankscope.protocol.envelope import Envelope
from rankscope.protocol.errors import WireError
from rankscope.protocol.trace_rows import decode_chunk
from rankscope.protocol.trace_summary import decode_summary
from rankscope.storage.columns import (
    HI,
    HI32,
    I32,
    I64,
    LO,
    LO32,
    TABLE_COLUMNS,
    U32,
    Columns,
    InvalidMessage,
    check_range,
    float_field,
    int_field,
    str_field,
)


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
        if (LO <= st <= HI and LO <= a <= HI and LO <= e <= HI and LO <= c <= HI
                and LO <= d <= HI):
            out.add_tuple((env.job, env.rank, st, a, e, d, c, d - c if d > c else 0, env.host, env.pid, env.seq))
            return st
    for name, col in (("step", steps), ("start_ns", starts), ("end_ns", ends), ("comm_ns", comms)):
        check_range(col, f"steps.{name}")
    durations = [e - s for s, e in zip(starts, ends, strict=True)]
    check_range(durations, "steps.end_ns-start_ns")
    busy = [d - c if d > c else 0 for d, c in zip(durations, comms, strict=True)]
    out.extend(n, job=env.job, rank=env.rank, step=steps, start_ns=starts, end_ns=ends, duration_ns=durations,
               comm_ns=comms, busy_ns=busy, host=env.host, pid=env.pid, seq=env.seq)
    return max(steps)


def heartbeat_row(env: Envelope) -> dict[str, Any]:
    b = env.body
    stacks = b["stacks"]
    return {"job": env.job, "rank": env.rank, "ts_ns": env.sent_ns, "step": int_field(b["step"], "heartbeat.step"),
            "since_step_s": float_field(b["since_step_s"], "heartbeat.since_step_s"),
            "dropped": int_field(b["dropped"], "heartbeat.dropped"), "host": env.host, "pid": env.pid,
            "seq": env.seq, "stacks": "" if stacks is None else json.dumps(stacks, separators=(",", ":"))}


def flight_row(env: Envelope) -> dict[str, Any]:
    b = env.body
    steps = [_int_list(r, "flight.steps[]", len(r) if isinstance(r, list) else -1) for r in b["steps"]]
    stacks = b["stacks"]
    return {"job": env.job, "rank": env.rank, "ts_ns": env.sent_ns, "request_id": str(b.get("request_id", "")),
            "reason": b["reason"], "host": env.host, "pid": env.pid, "steps": json.dumps(steps, separators=(",", ":")),
            "stacks": "" if stacks is None else json.dumps(stacks, separators=(",", ":"))}


def fr_dump_row(env: Envelope) -> dict[str, Any]:
    """A rank's Flight Recorder dump; its JSON must parse to an object with ``entries``."""
    b = env.body
    try:
        dump = json.loads(b["dump"])
    except ValueError as e:
        raise InvalidMessage("bad_body", f"fr_dump.dump is not JSON: {e}") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        raise InvalidMessage("bad_body", "fr_dump.dump has no entries list")
    return {"job": env.job, "rank": env.rank, "ts_ns": env.sent_ns, "request_id": b["request_id"][:200],
            "reason": b["reason"][:200], "host": env.host, "pid": env.pid, "truncated": int(b["truncated"]),
            "dump": b["dump"]}


def profile_columns(env: Envelope, out: Columns) -> int:
    """A ``profile`` message's call paths, one row each (``path`` "" holds a role's samples that
    left the message's rows), of an envelope wire.decode accepted (it validated the body). Returns
    the rows added."""
    try:
        rows = profile.rows(profile.from_validated(env.body))
    except ValueError as e:
        raise InvalidMessage("bad_body", str(e)) from None
    b = env.body
    t0, dt, hz = b["t0_ns"], b["t1_ns"] - b["t0_ns"], float(b["hz"])
    int_field(t0, "profile.t0_ns")
    int_field(dt, "profile.interval")
    job, rank, host, pid = env.job, env.rank, env.host, env.pid
    out.add_tuples([(job, rank, host, pid, t0, dt, role, path, n, hz) for role, path, n in rows])
    return len(rows)


STATS_FIELDS: dict[str, Callable[[Any, str], Any]] = {
    "rank": lambda v, n: int_field(v, n, I32), "ts_ns": int_field, "step": int_field,
    "window_steps": lambda v, n: int_field(v, n, I32), "median_step_ns": int_field, "p95_step_ns": int_field,
    "median_busy_ns": int_field, "median_comm_ns": int_field, "busy_z": float_field, "state": str_field,
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
        if not (type(r) is int and LO32 <= r <= HI32 and type(ts) is int and LO <= ts <= HI
                and type(st) is int and LO <= st <= HI and type(ws) is int and LO32 <= ws <= HI32
                and type(med) is int and LO <= med <= HI and type(p95) is int and LO <= p95 <= HI
                and type(mb) is int and LO <= mb <= HI and type(mc) is int and LO <= mc <= HI
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


def hw_columns(env: Envelope, out: Columns) -> int:
    """Columnar samples -> long format, one row per (sample, metric); None values are skipped.
    Returns the number of rows added."""
    n = hw_columns_fast(env, out)
    if n is None:   # something the fast path does not take: the checked path stores or rejects it
        before = out.rows
        hw_columns_checked(env, out)
        return out.rows - before
    return n


_FLOAT_ONLY = frozenset((float,))
_LIST_ONLY = frozenset((list,))
_STR_ONLY = frozenset((str,))
_INT_OR_FLOAT = frozenset((int, float))
_NUMBERS_OR_NONE = frozenset((float, int, type(None)))


def _flat_numbers(metrics: dict[Any, Any], n: int) -> tuple[list[Any], list[bool] | None] | None:
    """Every metric's values, metric after metric, when every name is a string and every value list
    holds ``n`` ints, floats or Nones: (the values, ints as floats; which ones are not None, or None
    when all are); otherwise None."""
    if not metrics or set(map(type, metrics.values())) != _LIST_ONLY or set(map(len, metrics.values())) != {n} \
            or not set(map(type, metrics)) <= _STR_ONLY:
        return None
    flat = list(chain.from_iterable(metrics.values()))
    types = set(map(type, flat))
    if types <= _FLOAT_ONLY:
        return flat, None
    if types <= _INT_OR_FLOAT:
        return list(map(float, flat)), None
    if types <= _NUMBERS_OR_NONE:
        keep = list(map(is_not, flat, repeat(None)))
        return list(map(float, compress(flat, keep))), keep
    return None


def hw_columns_fast(env: Envelope, out: Columns) -> int | None:
    """The ``hw_samples`` rows of a well-formed ``hw`` message appended to ``out`` column by column
    (no row tuples: a Hopper rank's message makes ~100 rows), with their count; or None, appending
    nothing, if anything needs a closer look (:func:`hw_columns_checked` then gives the exact rows or
    the exact error). Rows come metric by metric, as the checked path makes them."""
    b = env.body
    ts, devices, metrics = b["ts_ns"], b["device"], b["metrics"]
    n = len(ts)
    if len(devices) != n or type(metrics) is not dict:
        return None
    for t in ts:
        if type(t) is not int or not LO <= t <= HI:
            return None
    for d in devices:
        if type(d) is not int or not LO32 <= d <= HI32:
            return None
    # Every metric a list of n numbers or Nones (NVML gives ints for memory sizes and error counts):
    # checked, converted and appended in a few C-level passes over all the message's values.
    flat_keep = _flat_numbers(metrics, n)
    if flat_keep is None:
        return None
    flat, keep = flat_keep
    m = len(metrics)
    metric_col = [name for name in metrics for _ in range(n)]
    total = len(flat)
    cols = out.data
    cols["value"].extend(flat)
    if keep is None:
        cols["ts_ns"].extend(ts * m)
        cols["device"].extend(devices * m)
        cols["metric"].extend(metric_col)
    else:
        cols["ts_ns"].extend(compress(ts * m, keep))
        cols["device"].extend(compress(devices * m, keep))
        cols["metric"].extend(compress(metric_col, keep))
    cols["job"].extend(repeat(env.job, total))
    cols["rank"].extend(repeat(env.rank, total))
    cols["host"].extend(repeat(env.host, total))
    out.rows += total
    return total


def hw_columns_checked(env: Envelope, out: Columns) -> None:
    b = env.body
    ts, devices, metrics = b["ts_ns"], b["device"], b["metrics"]
    n = len(ts)
    if len(devices) != n:
        raise InvalidMessage("bad_body", f"hw.device has {len(devices)} values, ts_ns has {n}")
    ts = [int_field(t, "hw.ts_ns") for t in ts]
    devices = [int_field(d, "hw.device", I32) for d in devices]
    for name, values in metrics.items():
        if not isinstance(name, str) or not isinstance(values, list) or len(values) != n:
            raise InvalidMessage("bad_body", f"hw.metrics[{name!r}] must be a list of {n} values")
        for t, d, v in zip(ts, devices, values, strict=True):
            if v is not None:
                out.add_row(job=env.job, rank=env.rank, host=env.host, device=d, ts_ns=t, metric=name,
                            value=float_field(v, f"hw.metrics[{name!r}]"))


def _int_list(values: Any, name: str, n: int, bounds: tuple[int, int] = I64) -> list[int]:
    if not isinstance(values, list) or len(values) != n:
        raise InvalidMessage("bad_body", f"{name} must be a list of {n} values")
    if not all(type(v) is int for v in values):
        raise InvalidMessage("bad_body", f"{name} holds a non-integer")
    check_range(values, name, bounds)
    return values


def trace_columns(env: Envelope, out: Columns) -> int:
    """A ``trace`` chunk -> ``trace_events`` rows (:func:`rankscope.protocol.trace_rows.decode_chunk`
    validates it whole first, so a bad chunk adds nothing). Returns the row count."""
    try:
        c = decode_chunk(env.body)
    except WireError as e:
        raise InvalidMessage(e.reason, e.detail) from None
    n = c["n"]
    if n:
        out.extend(n, job=env.job, window_id=c["window_id"], rank=env.rank, category=c["category"], name=c["name"],
                   start_ns=c["start_ns"], dur_ns=c["dur_ns"], device=c["device"], stream=c["stream"],
                   step=c["step"], bytes=c["bytes"], attrs=c["attrs"], correlation=c["correlation"],
                   external_id=c["external_id"])
    return n


def summary_columns(env: Envelope, out: Columns) -> dict[str, Any]:
    """A ``summary`` message -> ``function_summaries`` rows (appended to ``out``) and the window's
    ``trace_windows`` row (returned). ``events`` in that row is ``events_sent``: the number of
    ``trace_events`` rows the window should have; ``truncated`` says whether the rank left some out."""
    try:
        f, w = decode_summary(env.body)
    except WireError as e:
        raise InvalidMessage(e.reason, e.detail) from None
    window = {"job": env.job, "rank": env.rank, **w, "truncated": int(w["truncated"]), "updated_ns": env.sent_ns}
    n = f.pop("n")
    if n:
        out.extend(n, job=env.job, window_id=w["window_id"], rank=env.rank, **f)
    return window


def report_row(value: bytes | None) -> dict[str, Any]:
    """A diagnosis report (JSON from the processors) -> one ``reports`` row."""
    try:
        rep = json.loads(value or b"")
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidMessage("bad_report", f"not JSON: {e}") from None
    if not isinstance(rep, dict) or rep.get("schema_version") != 1:
        raise InvalidMessage("bad_report", f"unknown report schema_version {rep.get('schema_version') if isinstance(rep, dict) else None!r}")
    return {"job": str_field(rep.get("job"), "report.job"), "window_id": str_field(rep.get("window_id"), "report.window_id"),
            "created_ns": int(rep.get("created_ns") or time.time_ns()), "body": (value or b"").decode()}


def alert_rows(alert: Alert) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``alerts`` row (latest state, body = the whole JSON) and the ``alert_events`` row."""
    if not isinstance(alert.ranks, list):
        raise InvalidMessage("bad_alert", "ranks is not a list")
    body = alert.to_json().decode()
    try:
        row = {"alert_id": str_field(alert.alert_id, "alert_id"), "job": str_field(alert.job, "job"), "kind": alert.kind,
               "status": alert.status, "severity": str_field(alert.severity, "severity"),
               "ranks": [int_field(r, "ranks[]", I32) for r in alert.ranks], "step": int_field(alert.step, "step"),
               "opened_ns": int_field(alert.opened_ns, "opened_ns"), "updated_ns": int_field(alert.updated_ns, "updated_ns"),
               "resolved_ns": int_field(alert.resolved_ns, "resolved_ns"), "version": int_field(alert.version, "version", U32),
               "summary": str_field(alert.summary, "summary"),
               "lost_rank_seconds": float_field(alert.lost_rank_seconds, "lost_rank_seconds"), "body": body}
    except InvalidMessage as e:
        raise InvalidMessage("bad_alert", e.detail) from None
    event = {k: row[k] for k in TABLE_COLUMNS["alert_events"]}
    return row, event


def deadletter_row(dl: DeadLetter) -> dict[str, Any]:
    try:
        return {"ts_ns": int_field(dl.ts_ns, "ts_ns"), "source_topic": str_field(dl.source_topic, "source_topic"),
                "partition": int_field(dl.partition, "partition", I32), "offset": int_field(dl.offset, "offset"),
                "stage": str_field(dl.stage, "stage"), "reason": str_field(dl.reason, "reason"),
                "detail": str_field(dl.detail, "detail"), "payload_b64": str_field(dl.payload_b64, "payload_b64")}
    except InvalidMessage as e:
        raise InvalidMessage("bad_deadletter", e.detail) from None


# --------------------------------------------------------------------------------------------
# Rank and job state (carried forward so every upsert row is complete)
# --------------------------------------------------------------------------------------------

def new_rank(job: str, rank: int) -> dict[str, Any]:
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
