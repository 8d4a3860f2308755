"""Messages into a batch of rows, with the state the ``ranks`` and ``jobs`` upserts need.

:class:`RowBuilder` takes each consumed message's value (with its topic), converts it with
storage/rows.py and appends the rows to a :class:`Batch`; it also keeps the latest known state of
every (job, rank) and job, because ``ranks`` and ``jobs`` are ReplacingMergeTree(last_seen_ns)
tables whose every row must be complete. No Kafka and no store: storage/sink.py consumes, writes
the batch and commits.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rankscope.protocol.alerts import Alert
from rankscope.protocol.deadletter import DeadLetter
from rankscope.protocol.envelope import Envelope, decode, split_beat
from rankscope.protocol.errors import WireError
from rankscope.storage.columns import (
    HI,
    HI32,
    I32,
    LO,
    LO32,
    TABLE_COLUMNS,
    Columns,
    InvalidMessage,
    int_field,
)
from rankscope.storage.rows import (
    alert_rows,
    deadletter_row,
    flight_row,
    fr_dump_row,
    heartbeat_row,
    hw_columns,
    merge_job,
    merge_rank,
    new_rank,
    profile_columns,
    report_row,
    stats_tuples,
    steps_columns,
    summary_columns,
    trace_columns,
)
from rankscope.topics import Topic

# Kinds the sink stores; other valid kinds on its topics are counted as skipped.
STORED_KINDS = frozenset({"steps", "heartbeat", "exit", "stats", "hw", "trace", "summary", "flight", "fr_dump",
                          "profile"})


@dataclass
class Batch:
    started_at: float
    tables: dict[str, Columns] = field(default_factory=dict)
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)   # (topic, partition) -> next offset
    messages: int = 0
    rows: int = 0
    dead_letters: int = 0
    ranks: set[tuple[str, int]] = field(default_factory=set)            # dirty (job, rank) keys
    urgent_ranks: set[tuple[str, int]] = field(default_factory=set)     # of those, more than progress changed
    jobs: set[str] = field(default_factory=set)                         # dirty jobs
    done: set[str] = field(default_factory=set)                         # tables already written
    attempts: int = 0

    def table(self, name: str) -> Columns:
        cols = self.tables.get(name)
        if cols is None:
            cols = self.tables[name] = Columns(TABLE_COLUMNS[name])
        return cols


class RowBuilder:
    """Converts messages into a :class:`Batch` and keeps the rank and job state (see the module doc).

    :meth:`add` raises :class:`InvalidMessage` for a message that cannot be stored, having added
    nothing of it. ``skipped`` counts valid messages of kinds the store does not keep.
    """

    def __init__(self) -> None:
        self.ranks: dict[tuple[str, int], dict[str, Any]] = {}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.skipped: Counter[str] = Counter()

    def add(self, topic: Topic | None, value: bytes | None, batch: Batch) -> None:
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
        if not (LO32 <= env.rank <= HI32 and LO32 <= env.pid <= HI32 and LO <= env.sent_ns <= HI
                and LO <= env.seq <= HI):
            int_field(env.rank, "rank", I32)
            int_field(env.pid, "pid", I32)
            int_field(env.sent_ns, "sent_ns")
            int_field(env.seq, "seq")
        kind = env.kind
        if kind == "beat":
            if not self._beat(env, batch):
                for part in split_beat(env):
                    self._store(part, batch)
        elif kind == "hw":
            batch.rows += hw_columns(env, batch.table("hw_samples"))
        elif kind == "stats":
            rows = stats_tuples(env)
            batch.table("worker_stats").add_tuples(rows)
            batch.rows += len(rows)
        else:
            self._store(env, batch)

    def _beat(self, env: Envelope, batch: Batch) -> bool:
        """A well-formed v2 beat: its step rows, its heartbeat row and one observation of the rank, the
        same rows and state as storing :func:`split_beat`'s pair. Returns False, having added nothing,
        when anything needs a closer look (the split pair's checked path then stores or rejects it)."""
        b = env.body
        step, since, dropped, ws, lr = b["hb_step"], b["since_step_s"], b["dropped"], b["world_size"], b["local_rank"]
        ts = type(since)
        if not (type(step) is int and LO <= step <= HI and (ts is float or ts is int) and type(dropped) is int
                and LO <= dropped <= HI and type(ws) is int and LO32 <= ws <= HI32 and type(lr) is int
                and LO32 <= lr <= HI32):
            return False
        steps = b["step"]
        job, rank, host, pid, seq, sent = env.job, env.rank, env.host, env.pid, env.seq, env.sent_ns
        last = -1
        if len(steps) == 1:
            st, a, e, c = steps[0], b["start_ns"][0], b["end_ns"][0], b["comm_ns"][0]
            d = e - a
            if not (LO <= st <= HI and LO <= a <= HI and LO <= e <= HI and LO <= c <= HI and LO <= d <= HI):
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
        state = self.ranks.get(key)
        seen, pid = env.sent_ns, env.pid
        if state is not None and state["pid"] == pid and seen >= state["last_seen_ns"]:
            # merge_rank's common case: the same process, a newer observation, no exit.
            if last_step > state["last_step"]:
                state["last_step"] = last_step
            if ((env.host != "" and env.host != state["host"]) or (world_size != -1 and world_size != state["world_size"])
                    or (local_rank != -1 and local_rank != state["local_rank"])):
                batch.urgent_ranks.add(key)
                if env.host != "":
                    state["host"] = env.host
                if world_size != -1:
                    state["world_size"] = world_size
                if local_rank != -1:
                    state["local_rank"] = local_rank
            state["last_seen_ns"] = seen
            job = self.jobs.get(env.job)
            if job is not None and 0 < job["first_seen_ns"] <= seen:
                # merge_job's common cases: a newer observation, or an older one (beats of other
                # partitions read first) that only fills an unknown world size
                if seen >= job["last_seen_ns"]:
                    if world_size > 0:
                        job["world_size"] = world_size
                    job["last_seen_ns"] = seen
                elif world_size > 0 and job["world_size"] <= 0:
                    job["world_size"] = world_size
                batch.ranks.add(key)
                batch.jobs.add(env.job)
                return
            merge_job(self._job(env.job), {"world_size": world_size, "last_seen_ns": seen})
            batch.ranks.add(key)
            batch.jobs.add(env.job)
            return
        self._observe(batch, env, {"last_step": last_step, "world_size": world_size, "local_rank": local_rank})

    def _job(self, job_id: str) -> dict[str, Any]:
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = {"job": job_id, "world_size": -1, "first_seen_ns": 0, "last_seen_ns": 0}
        return job

    def _store(self, env: Envelope, batch: Batch) -> None:
        kind = env.kind
        if kind not in STORED_KINDS:
            self.skipped[kind] += 1
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
                                       "world_size": int_field(b["world_size"], "heartbeat.world_size", I32),
                                       "local_rank": int_field(b["local_rank"], "heartbeat.local_rank", I32)})
        elif kind == "exit":
            b = env.body
            self._observe(batch, env, {"last_step": int_field(b["step"], "exit.step"), "exit_reason": b["reason"],
                                       "exit_detail": b["detail"]})
        elif kind == "stats":
            rows = stats_tuples(env)
            batch.table("worker_stats").add_tuples(rows)
            batch.rows += len(rows)
        elif kind == "hw":
            batch.rows += hw_columns(env, batch.table("hw_samples"))
        elif kind == "trace":
            batch.rows += trace_columns(env, batch.table("trace_events"))
        elif kind == "flight":
            self._add_row(batch, "flight_records", flight_row(env))
        elif kind == "fr_dump":
            self._add_row(batch, "fr_dumps", fr_dump_row(env))
        elif kind == "profile":
            batch.rows += profile_columns(env, batch.table("profile_samples"))
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
        state = self.ranks.get(key)
        if state is None:
            state = self.ranks[key] = new_rank(env.job, env.rank)
            batch.urgent_ranks.add(key)
        before = _identity(state)
        upd = {"host": env.host, "pid": env.pid, "last_seen_ns": env.sent_ns, **upd}
        merge_rank(state, upd)
        if _identity(state) != before:
            batch.urgent_ranks.add(key)
        job = self.jobs.get(env.job)
        if job is None:
            job = self.jobs[env.job] = {"job": env.job, "world_size": -1, "first_seen_ns": 0, "last_seen_ns": 0}
        merge_job(job, {"world_size": upd.get("world_size", -1), "last_seen_ns": env.sent_ns})
        batch.ranks.add(key)
        batch.jobs.add(env.job)


def _identity(state: dict[str, Any]) -> tuple[Any, ...]:
    """What of a rank's state is more than progress (last step, last seen): a change of it is written
    to the ``ranks`` table with the batch that saw it."""
    return (state["host"], state["pid"], state["world_size"], state["local_rank"], state["exit_reason"],
            state["exit_detail"])
