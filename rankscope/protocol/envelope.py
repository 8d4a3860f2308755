"""The envelope: one msgpack map per Kafka message, around a kind-specific body.

Envelope (every message)::

    {"v": SCHEMA_VERSION, "kind": str, "job": str, "rank": int, "host": str, "pid": int,
     "seq": int, "sent_ns": int, "body": {...}}

``seq`` is the producer's sequence number per (job, rank, pid): gaps mean loss, repeats mean
duplicates.

Versions: v2 ranks send one ``beat`` per heartbeat period, keyed by ``job/rank`` (:func:`rank_key`)
so one job spreads over partitions. v1 ranks send separate ``steps`` and ``heartbeat`` messages keyed
by job. Both versions decode; :func:`split_beat` turns a beat into the v1 pair, so every consumer
folds one shape. A kind that exists only from a version on (:data:`KIND_SINCE`) is refused in an
older envelope.

:func:`decode` validates at the boundary, envelope and body (:data:`BODY_CHECKS`: each kind's check,
in the module of that kind), and raises :class:`WireError` with a reason that the caller routes to
the dead-letter topic. It never returns a half-valid message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from rankscope.protocol import (
    control,
    exits,
    flight,
    hardware,
    profile,
    shard,
    stats,
    steps,
    trace_events,
    trace_summary,
)
from rankscope.protocol.errors import WireError, bad_body

SCHEMA_VERSION = 2
SUPPORTED_VERSIONS = frozenset({1, 2})
# Kinds that exist only from a version on; an older envelope carrying one is refused.
KIND_SINCE = {"beat": 2, "shard": 2, "fr_dump": 2, "profile": 2}
ENVELOPE_FIELDS = ("v", "kind", "job", "rank", "host", "pid", "seq", "sent_ns", "body")

# kind -> the check of its body, which raises WireError("bad_body") naming the field.
BODY_CHECKS: dict[str, Callable[[dict[str, Any]], object]] = {
    "steps": steps.check_steps,
    "heartbeat": steps.check_heartbeat,
    "beat": steps.check_beat,
    "shard": shard.check_shard,
    "exit": exits.check_exit,
    "hw": hardware.check_hw,
    "control": control.check_control,
    "ack": control.check_ack,
    "trace": trace_events.check_trace,
    "summary": trace_summary.check_summary,
    "flight": flight.check_flight,
    "fr_dump": flight.check_fr_dump,
    "stats": stats.check_stats,
    "profile": profile.validate,
}


@dataclass(frozen=True)
class Envelope:
    kind: str
    job: str
    rank: int
    host: str
    pid: int
    seq: int
    sent_ns: int
    body: dict[str, Any]
    v: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"v": self.v, "kind": self.kind, "job": self.job, "rank": self.rank, "host": self.host,
                "pid": self.pid, "seq": self.seq, "sent_ns": self.sent_ns, "body": self.body}


def encode(env: Envelope) -> bytes:
    """Pack an envelope. Raises WireError if the body does not match its kind."""
    check = BODY_CHECKS.get(env.kind)
    if check is None:
        raise WireError("unknown_kind", repr(env.kind))
    if type(env.body) is not dict:
        raise bad_body("body is not a map")
    check(env.body)
    return msgpack.packb(env.to_dict(), use_bin_type=True)


def decode(data: bytes | None) -> Envelope:
    """Unpack and validate one message. Raises WireError(reason) on any problem.

    Reasons: ``empty``, ``not_msgpack``, ``not_a_map``, ``missing_field``, ``bad_type``,
    ``unknown_version``, ``unknown_kind``, ``bad_body``. Types are checked exactly (a bool is not an int).
    """
    if not data:
        raise WireError("empty", "message has no payload")
    try:
        obj = _unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError("not_msgpack", f"{type(e).__name__}: {e}") from None
    if type(obj) is not dict:
        raise WireError("not_a_map", f"top level is {type(obj).__name__}")
    try:
        v, kind, job, rank, host = obj["v"], obj["kind"], obj["job"], obj["rank"], obj["host"]
        pid, seq, sent_ns, body = obj["pid"], obj["seq"], obj["sent_ns"], obj["body"]
    except KeyError:
        raise _missing_field(obj) from None
    if type(v) is not int or v not in SUPPORTED_VERSIONS:
        raise _unknown_version(v)
    if type(kind) is not str:
        raise _bad_type("kind", kind)
    if type(job) is not str:
        raise _bad_type("job", job)
    if type(rank) is not int:
        raise _bad_type("rank", rank)
    if type(host) is not str:
        raise _bad_type("host", host)
    if type(pid) is not int:
        raise _bad_type("pid", pid)
    if type(seq) is not int:
        raise _bad_type("seq", seq)
    if type(sent_ns) is not int:
        raise _bad_type("sent_ns", sent_ns)
    if type(body) is not dict:
        raise _bad_type("body", body)
    if not job:
        raise WireError("bad_type", "job is empty")
    check = BODY_CHECKS.get(kind)
    if check is None:
        raise WireError("unknown_kind", repr(kind))
    since = KIND_SINCE.get(kind)
    if since is not None and since > v:
        raise WireError("unknown_kind", f"{kind!r} needs schema version {since}, got {v}")
    check(body)
    return _trusted_envelope(kind, job, rank, host, pid, seq, sent_ns, body, v)


_unpackb = msgpack.unpackb


def _missing_field(obj: dict[str, Any]) -> WireError:
    """The error of an envelope without a field: ``v`` first, a bad ``v`` before the others."""
    if "v" in obj and not (type(obj["v"]) is int and obj["v"] in SUPPORTED_VERSIONS):
        return _unknown_version(obj["v"])
    return WireError("missing_field", next(name for name in ENVELOPE_FIELDS if name not in obj))


def _unknown_version(v: Any) -> WireError:
    return WireError("unknown_version", f"schema version {v!r}, supported {sorted(SUPPORTED_VERSIONS)}")


def _bad_type(name: str, value: Any) -> WireError:
    return WireError("bad_type", f"{name} is {type(value).__name__}")


def _trusted_envelope(kind: str, job: str, rank: int, host: str, pid: int, seq: int, sent_ns: int,
                      body: dict[str, Any], v: int) -> Envelope:
    """An Envelope of fields already checked. Envelope's generated __init__ sets each field through
    object.__setattr__ (it is frozen), which costs more than the checks; filling the instance dict
    gives the same object."""
    env = _new_object(Envelope)
    env.__dict__.update(kind=kind, job=job, rank=rank, host=host, pid=pid, seq=seq, sent_ns=sent_ns, body=body, v=v)
    return env


_new_object = object.__new__


def rank_key(job: str, rank: int) -> bytes:
    """The Kafka key of a v2 rank's steps-topic messages: spreads a job over partitions by rank."""
    return f"{job}/{rank}".encode()


def split_beat(env: Envelope) -> tuple[Envelope, Envelope]:
    """A v2 ``beat`` as the v1 pair it replaces: (``steps``, ``heartbeat``), same envelope fields.
    This is where v1 and v2 meet: consumers fold the pair, whichever version sent it."""
    b = env.body
    steps_body = {c: b[c] for c in steps.STEP_COLUMNS}
    hb = {"step": b["hb_step"], **{f: b[f] for f in steps.HEARTBEAT_FIELDS},
          **{f: b[f] for f in steps.HEARTBEAT_OPTIONAL if f in b}}

    def part(kind: str, body: dict[str, Any]) -> Envelope:
        return _trusted_envelope(kind, env.job, env.rank, env.host, env.pid, env.seq, env.sent_ns, body, env.v)

    return part("steps", steps_body), part("heartbeat", hb)


def steps_rows(env: Envelope) -> list[dict[str, int]]:
    """The step records of a ``steps`` message as row dicts."""
    b = env.body
    return [{"step": s, "start_ns": a, "end_ns": e, "comm_ns": c}
            for s, a, e, c in zip(b["step"], b["start_ns"], b["end_ns"], b["comm_ns"], strict=True)]
