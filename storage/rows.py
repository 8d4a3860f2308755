"""Messages to rows: pure functions from one decoded message to the rows of the store's tables.

Each validates what :func:`rankscope.protocol.envelope.decode` leaves unchecked (value ranges, the shapes inside
a body) and raises :class:`~rankscope.storage.columns.InvalidMessage` before it appends anything. No Kafka
and no store here (storage/convert.py applies them to a batch, storage/sink.py consumes).
"""

from __future__ import annotations

import json
import time
from itertools import chain, compress, repeat
from operator import is_not
from typing import Any

from rankscope.protocol import profile
from rankscope.protocol.alerts import Alert
from rankscope.protocol.deadletter import DeadLetter
from rankscope.protocol.envelope import Envelope
from rankscope.protocol.errors import WireError
from rankscope.protocol.flight import dump_of
from rankscope.protocol.trace_rows import decode_chunk
from rankscope.protocol.trace_summary import decode_summary
from rankscope.storage.columns import (
    HI,
    I32,
    LO,
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
    steps = b["steps"]
    stacks = b["stacks"]
    return {"job": env.job, "rank": env.rank, "ts_ns": env.sent_ns, "request_id": str(b.get("request_id", "")),
            "reason": b["reason"], "host": env.host, "pid": env.pid, "steps": json.dumps(steps, separators=(",", ":")),
            "stacks": "" if stacks is None else json.dumps(stacks, separators=(",", ":"))}


def fr_dump_row(env: Envelope) -> dict[str, Any]:
    """A rank's Flight Recorder dump; its JSON must parse to an object with ``entries``
    (:func:`rankscope.protocol.flight.dump_of`)."""
    b = env.body
    try:
        dump_of(b)
    except WireError as e:
        raise InvalidMessage(e.reason, e.detail) from None
    return {"job": env.job, "rank": env.rank, "ts_ns": env.sent_ns, "request_id": b["request_id"][:200],
            "reason": b["reason"][:200], "host": env.host, "pid": env.pid, "truncated": int(b["truncated"]),
            "dump": b["dump"]}


def profile_columns(env: Envelope, out: Columns) -> int:
    """A ``profile`` message's call paths, one row each (``path`` "" holds a role's samples that
    left the message's rows), of an envelope wire.decode accepted (it validated the body). Returns
    the rows added."""
    try:
        rows = profile.rows(profile.from_validated(env.body))
    except WireError as e:
        raise InvalidMessage(e.reason, e.detail) from None
    b = env.body
    t0, dt, hz = b["t0_ns"], b["t1_ns"] - b["t0_ns"], float(b["hz"])
    int_field(t0, "profile.t0_ns")
    int_field(dt, "profile.interval")
    job, rank, host, pid = env.job, env.rank, env.host, env.pid
    out.add_tuples([(job, rank, host, pid, t0, dt, role, path, n, hz) for role, path, n in rows])
    return len(rows)


def stats_tuples(env: Envelope) -> list[tuple[Any, ...]]:
    """The ``worker_stats`` rows of a decoded ``stats`` message (rankscope/protocol/stats.py checked
    it) as tuples in column order; ``cpu_wait_share`` is -1 where the entry has no ``cpu_wait``."""
    job = env.job
    return [(job, e["rank"], e["ts_ns"], e["step"], e["window_steps"], e["median_step_ns"], e["p95_step_ns"],
             e["median_busy_ns"], e["median_comm_ns"], float(e["busy_z"]), e["state"], float(e.get("cpu_wait", -1.0)))
            for e in env.body["ranks"]]


def hw_columns(env: Envelope, out: Columns) -> int:
    """The ``hw_samples`` rows of a decoded ``hw`` message (rankscope/protocol/hardware.py checked it),
    long format: one row per (sample, metric), metric by metric, nil values skipped. Appended column
    by column (a Hopper rank's message makes ~100 rows); returns their count."""
    b = env.body
    ts, devices, metrics = b["ts_ns"], b["device"], b["metrics"]
    n, m = len(ts), len(metrics)
    flat = list(chain.from_iterable(metrics.values()))
    types = set(map(type, flat))
    keep: list[bool] | None = None
    if types <= _FLOAT_ONLY:
        values = flat
    elif type(None) not in types:
        values = list(map(float, flat))
    else:
        keep = list(map(is_not, flat, repeat(None)))
        values = list(map(float, compress(flat, keep)))
    metric_col = [name for name in metrics for _ in range(n)]
    total = len(values)
    cols = out.data
    cols["value"].extend(values)
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


_FLOAT_ONLY = frozenset((float,))


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
