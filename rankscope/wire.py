"""The wire format: one msgpack map per Kafka message, an envelope around a kind-specific body.

Envelope (every message)::

    {"v": SCHEMA_VERSION, "kind": str, "job": str, "rank": int, "host": str, "pid": int,
     "seq": int, "sent_ns": int, "body": {...}}

``seq`` is the producer's sequence number per (job, rank, pid): gaps mean loss, repeats mean
duplicates. Bodies are columnar where a message carries many records (``steps``).

Versions: v2 ranks send one ``beat`` per heartbeat period (the step records since the last beat
plus the heartbeat fields), keyed by ``job/rank`` (:func:`rank_key`) so one job spreads over
partitions. v1 ranks send separate ``steps`` and ``heartbeat`` messages keyed by job; both
versions decode, and :func:`split_beat` turns a beat into the v1 pair so every consumer folds
one shape. ``shard`` is the processors' own per-partition job summary (stream_processors/shard.py).

:func:`decode` validates at the boundary and raises :class:`WireError` with a reason that the
caller routes to the dead-letter topic. It never returns a half-valid message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from rankscope.protocol import collectives
from rankscope.protocol import profile as _profile
from rankscope.wire_error import WireError

SCHEMA_VERSION = 2
SUPPORTED_VERSIONS = frozenset({1, 2})
# Kinds that exist only from a version on; a v1 envelope carrying one is rejected.
KIND_SINCE = {"beat": 2, "shard": 2, "fr_dump": 2, "profile": 2}


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


_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_LIST = (list,)
_OPT_LIST = (list, type(None))

# kind -> {field: allowed types}; required fields of the body.
BODY_SCHEMAS: dict[str, dict[str, tuple[type, ...]]] = {
    # Columnar step records: equal-length lists.
    "steps": {"step": _LIST, "start_ns": _LIST, "end_ns": _LIST, "comm_ns": _LIST},
    "heartbeat": {"step": _INT, "since_step_s": _NUM, "dropped": _INT, "world_size": _INT,
                  "local_rank": _INT, "stacks": _OPT_LIST},
    # v2: step records (columnar, as in "steps") and the heartbeat fields ("hb_step" is the
    # heartbeat's "step") in one message per rank per heartbeat period; optional "coll": the rank's
    # collectives since its last beat (rankscope/protocol/collectives.py).
    "beat": {"step": _LIST, "start_ns": _LIST, "end_ns": _LIST, "comm_ns": _LIST, "hb_step": _INT,
             "since_step_s": _NUM, "dropped": _INT, "world_size": _INT, "local_rank": _INT,
             "stacks": _OPT_LIST},
    # Processors' per-partition job summary (stream_processors/shard.py validates the rest).
    "shard": {"shard": _INT, "ts_ns": _INT, "agg": (dict,), "rows": _LIST, "stacks": (dict,)},
    # "exception" exits may add "exc_type" (str) and "frames" (the traceback, "file:line func",
    # outermost first, at most 48): both optional, validated when present.
    "exit": {"step": _INT, "reason": _STR, "detail": _STR},
    # Hardware samples (columnar): metric name -> list of values, plus ts_ns list.
    "hw": {"ts_ns": _LIST, "device": _LIST, "metrics": (dict,)},
    "control": {"command": _STR, "request_id": _STR, "ranks": _OPT_LIST, "args": (dict,)},
    "ack": {"request_id": _STR, "status": _STR, "detail": _STR},
    "trace": {"window_id": _STR, "events": (dict,)},
    "summary": {"window_id": _STR, "functions": (dict,)},
    "flight": {"steps": _LIST, "stacks": _OPT_LIST, "reason": _STR},
    # PyTorch's Flight Recorder dump of a rank (its JSON form), sent with "flight" on a hang or a request.
    "fr_dump": {"request_id": _STR, "reason": _STR, "dump": _STR, "truncated": (bool,)},
    "stats": {"ranks": _LIST},
}

STEP_COLUMNS = ("step", "start_ns", "end_ns", "comm_ns")
EXIT_REASONS = frozenset({"completed", "exception", "signal", "atexit"})


def encode(env: Envelope) -> bytes:
    """Pack an envelope. Raises WireError if the body does not match its kind's schema."""
    _validate_body(env.kind, env.body)
    return msgpack.packb(env.to_dict(), use_bin_type=True)


def decode(data: bytes | None) -> Envelope:
    """Unpack and validate one message. Raises WireError(reason) on any problem.

    Reasons: ``empty``, ``not_msgpack``, ``not_a_map``, ``missing_field``, ``bad_type``,
    ``unknown_version``, ``unknown_kind``, ``bad_body``.

    A well-formed message of the high-rate kinds (``beat``, ``steps``, ``heartbeat``, ``hw``) is
    accepted by exact type checks (:func:`_fast_envelope`); anything they do not accept goes through
    the full checks, which accept or reject it with the reason. The fast checks accept a subset of
    what the full checks accept, so both give the same answer for every message.
    """
    if not data:
        raise WireError("empty", "message has no payload")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError("not_msgpack", f"{type(e).__name__}: {e}") from None
    env = _fast_envelope(obj) if type(obj) is dict else None
    return env if env is not None else _checked_envelope(obj)


def _fast_envelope(obj: dict[str, Any]) -> Envelope | None:
    """The envelope of a well-formed message of a high-rate kind, or None to take the full checks."""
    try:
        v, kind, job, rank, host = obj["v"], obj["kind"], obj["job"], obj["rank"], obj["host"]
        pid, seq, sent_ns, body = obj["pid"], obj["seq"], obj["sent_ns"], obj["body"]
    except KeyError:
        return None
    if not (type(v) is int and v in SUPPORTED_VERSIONS and type(kind) is str and type(job) is str and job
            and type(rank) is int and type(host) is str and type(pid) is int and type(seq) is int
            and type(sent_ns) is int and type(body) is dict and KIND_SINCE.get(kind, 1) <= v):
        return None
    check = _FAST_BODY_CHECKS.get(kind)
    if check is None or not check(body):
        return None
    return _trusted_envelope(kind, job, rank, host, pid, seq, sent_ns, body, v)


def _trusted_envelope(kind: str, job: str, rank: int, host: str, pid: int, seq: int, sent_ns: int,
                      body: dict[str, Any], v: int) -> Envelope:
    """An Envelope of fields already checked. Envelope's generated __init__ sets each field through
    object.__setattr__ (it is frozen), which costs more than the checks; filling the instance dict
    gives the same object."""
    env = _new_object(Envelope)
    env.__dict__.update(kind=kind, job=job, rank=rank, host=host, pid=pid, seq=seq, sent_ns=sent_ns, body=body, v=v)
    return env


_new_object = object.__new__


def _fast_step_columns(b: dict[str, Any]) -> bool:
    try:
        cols = (b["step"], b["start_ns"], b["end_ns"], b["comm_ns"])
    except KeyError:
        return False
    n = len(cols[0]) if type(cols[0]) is list else -1
    for col in cols:
        if type(col) is not list or len(col) != n:
            return False
        for x in col:
            if type(x) is not int:
                return False
    return True


def _fast_heartbeat_fields(b: dict[str, Any], step_field: str) -> bool:
    try:
        step, since, dropped = b[step_field], b["since_step_s"], b["dropped"]
        world_size, local_rank, stacks = b["world_size"], b["local_rank"], b["stacks"]
    except KeyError:
        return False
    ts = type(since)
    return (type(step) is int and (ts is float or ts is int) and type(dropped) is int and type(world_size) is int
            and type(local_rank) is int and stacks is None)   # stacks: the full checks look inside


def _fast_hw(b: dict[str, Any]) -> bool:
    try:
        return type(b["ts_ns"]) is list and type(b["device"]) is list and type(b["metrics"]) is dict
    except KeyError:
        return False


def _fast_coll(b: dict[str, Any]) -> bool:
    coll = b.get("coll")
    if coll is None:
        return True
    try:
        collectives.validate(coll)
    except WireError:
        return False     # the full checks reject it with the reason
    return True


_FAST_BODY_CHECKS = {
    "beat": lambda b: _fast_step_columns(b) and _fast_heartbeat_fields(b, "hb_step") and _fast_coll(b),
    "steps": _fast_step_columns,
    "heartbeat": lambda b: _fast_heartbeat_fields(b, "step"),
    "hw": _fast_hw,
}


def _checked_envelope(obj: Any) -> Envelope:
    if not isinstance(obj, dict):
        raise WireError("not_a_map", f"top level is {type(obj).__name__}")
    if "v" not in obj:
        raise WireError("missing_field", "v")
    if not isinstance(obj["v"], int) or obj["v"] not in SUPPORTED_VERSIONS:
        raise WireError("unknown_version", f"schema version {obj['v']!r}, supported {sorted(SUPPORTED_VERSIONS)}")
    for name, types in (("kind", _STR), ("job", _STR), ("rank", _INT), ("host", _STR), ("pid", _INT),
                        ("seq", _INT), ("sent_ns", _INT), ("body", (dict,))):
        if name not in obj:
            raise WireError("missing_field", name)
        if not isinstance(obj[name], types) or isinstance(obj[name], bool):
            raise WireError("bad_type", f"{name} is {type(obj[name]).__name__}")
    if not obj["job"]:
        raise WireError("bad_type", "job is empty")
    if KIND_SINCE.get(obj["kind"], 1) > obj["v"]:
        raise WireError("unknown_kind", f"{obj['kind']!r} needs schema version {KIND_SINCE[obj['kind']]}, got {obj['v']}")
    _validate_body(obj["kind"], obj["body"])
    return Envelope(kind=obj["kind"], job=obj["job"], rank=obj["rank"], host=obj["host"], pid=obj["pid"],
                    seq=obj["seq"], sent_ns=obj["sent_ns"], body=obj["body"], v=obj["v"])


def _validate_body(kind: str, body: dict[str, Any]) -> None:
    typed = PROTOCOL_KINDS.get(kind)
    if typed is not None:   # a kind whose struct and bounds live in rankscope/protocol
        if not isinstance(body, dict):
            raise WireError("bad_body", "body is not a map")
        try:
            typed(body)
        except ValueError as e:
            raise WireError("bad_body", str(e)) from None
        return
    schema = BODY_SCHEMAS.get(kind)
    if schema is None:
        raise WireError("unknown_kind", repr(kind))
    if not isinstance(body, dict):
        raise WireError("bad_body", "body is not a map")
    for name, types in schema.items():
        if name not in body:
            raise WireError("bad_body", f"{kind}.{name} missing")
        if not isinstance(body[name], types):
            raise WireError("bad_body", f"{kind}.{name} is {type(body[name]).__name__}")
    if kind in ("steps", "beat"):
        n = len(body["step"])
        for c in STEP_COLUMNS:
            col = body[c]
            if len(col) != n:
                raise WireError("bad_body", f"{kind}.{c} has {len(col)} values, step has {n}")
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in col):
                raise WireError("bad_body", f"{kind}.{c} holds a non-integer")
    if kind == "beat" and body.get("coll") is not None:
        collectives.validate(body["coll"])
    if kind in ("heartbeat", "beat") and body["stacks"] is not None:
        for s in body["stacks"]:
            if not (isinstance(s, dict) and isinstance(s.get("thread"), str) and isinstance(s.get("frames"), list)):
                raise WireError("bad_body", "heartbeat.stacks entries need thread and frames")
    elif kind == "exit":
        if body["reason"] not in EXIT_REASONS:
            raise WireError("bad_body", f"exit.reason {body['reason']!r} not in {sorted(EXIT_REASONS)}")
        if not isinstance(body.get("exc_type", ""), str):
            raise WireError("bad_body", "exit.exc_type is not a string")
        frames = body.get("frames", [])
        if not (isinstance(frames, list) and all(isinstance(f, str) for f in frames)):
            raise WireError("bad_body", "exit.frames must be a list of strings")


def steps_rows(env: Envelope) -> list[dict[str, int]]:
    """The step records of a ``steps`` message as row dicts."""
    b = env.body
    return [{"step": s, "start_ns": a, "end_ns": e, "comm_ns": c}
            for s, a, e, c in zip(b["step"], b["start_ns"], b["end_ns"], b["comm_ns"], strict=True)]


def rank_key(job: str, rank: int) -> bytes:
    """The Kafka key of a v2 rank's steps-topic messages: spreads a job over partitions by rank."""
    return f"{job}/{rank}".encode()


HEARTBEAT_FIELDS = ("since_step_s", "dropped", "world_size", "local_rank", "stacks")


def split_beat(env: Envelope) -> tuple[Envelope, Envelope]:
    """A v2 ``beat`` as the v1 pair it replaces: (``steps``, ``heartbeat``), same envelope fields."""
    b = env.body
    steps = {c: b[c] for c in STEP_COLUMNS}
    hb = {"step": b["hb_step"], **{f: b[f] for f in HEARTBEAT_FIELDS}}
    def part(kind: str, body: dict[str, Any]) -> Envelope:
        return _trusted_envelope(kind, env.job, env.rank, env.host, env.pid, env.seq, env.sent_ns, body, env.v)

    return part("steps", steps), part("heartbeat", hb)



# Kinds defined in rankscope/protocol: kind -> its validate(body), which raises ValueError.
PROTOCOL_KINDS: dict[str, Any] = {"profile": _profile.validate}
