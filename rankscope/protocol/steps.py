"""A rank's step records and heartbeats: the ``steps``, ``heartbeat`` (v1) and ``beat`` (v2) kinds.

``steps`` (v1) carries step records as equal-length integer columns::

    {"step": [int, ...], "start_ns": [...], "end_ns": [...], "comm_ns": [...]}

``heartbeat`` (v1) carries the rank's liveness::

    {"step": int, "since_step_s": float, "dropped": int, "world_size": int, "local_rank": int,
     "stacks": [{"thread": str, "frames": [str, ...]}, ...] | nil,
     "cpu": [cpu_ns, runq_ns]}                    # optional

``cpu`` is the training thread's CPU time and its time runnable but waiting for a CPU (the kernel's
run-queue wait), both cumulative since the thread started (/proc/<pid>/task/<tid>/schedstat);
absent where the rank cannot read them, and from ranks older than the field.

``beat`` (v2) is both in one message per rank per heartbeat period: the step columns, the
heartbeat's fields with its ``step`` named ``hb_step``, and optionally ``coll``, the rank's
collectives since its last beat (rankscope/protocol/collectives.py).
:func:`rankscope.protocol.envelope.split_beat` turns a beat into the v1 pair.

The checks are exact (``type(x) is int``: a bool is not an int) and raise WireError("bad_body").
"""

from __future__ import annotations

from typing import Any

from rankscope.protocol import collectives
from rankscope.protocol.errors import bad_body
from rankscope.protocol.fields import missing, wrong_type

STEP_COLUMNS = ("step", "start_ns", "end_ns", "comm_ns")
HEARTBEAT_FIELDS = ("since_step_s", "dropped", "world_size", "local_rank", "stacks")
HEARTBEAT_OPTIONAL = ("cpu",)


def check_steps(body: dict[str, Any]) -> None:
    """Check a ``steps`` body."""
    _check_step_columns("steps", body)


def check_heartbeat(body: dict[str, Any]) -> None:
    """Check a ``heartbeat`` body."""
    _check_heartbeat_fields("heartbeat", body, "step")


def check_beat(body: dict[str, Any]) -> None:
    """Check a ``beat`` body."""
    _check_step_columns("beat", body)
    _check_heartbeat_fields("beat", body, "hb_step")
    coll = body.get("coll")
    if coll is not None:
        collectives.validate(coll)


def _check_step_columns(kind: str, b: dict[str, Any]) -> None:
    try:
        cols = (b["step"], b["start_ns"], b["end_ns"], b["comm_ns"])
    except KeyError as e:
        raise missing(kind, e) from None
    n = len(cols[0]) if type(cols[0]) is list else 0
    for col in cols:
        if type(col) is not list or len(col) != n:
            raise _bad_column(kind, cols, n)
        for x in col:
            if type(x) is not int:
                raise _bad_column(kind, cols, n)


def _bad_column(kind: str, cols: tuple[Any, ...], n: int) -> Exception:
    """The error naming the first bad step column."""
    for name, col in zip(STEP_COLUMNS, cols, strict=True):
        if type(col) is not list:
            return wrong_type(f"{kind}.{name}", col)
        if len(col) != n:
            return bad_body(f"{kind}.{name} has {len(col)} values, step has {n}")
        if any(type(x) is not int for x in col):
            return bad_body(f"{kind}.{name} holds a non-integer")
    raise AssertionError("no bad column")


def _check_heartbeat_fields(kind: str, b: dict[str, Any], step_field: str) -> None:
    try:
        step, since, dropped = b[step_field], b["since_step_s"], b["dropped"]
        world_size, local_rank, stacks = b["world_size"], b["local_rank"], b["stacks"]
    except KeyError as e:
        raise missing(kind, e) from None
    if type(step) is not int:
        raise wrong_type(f"{kind}.{step_field}", step)
    if type(since) is not float and type(since) is not int:
        raise wrong_type(f"{kind}.since_step_s", since)
    if type(dropped) is not int:
        raise wrong_type(f"{kind}.dropped", dropped)
    if type(world_size) is not int:
        raise wrong_type(f"{kind}.world_size", world_size)
    if type(local_rank) is not int:
        raise wrong_type(f"{kind}.local_rank", local_rank)
    if stacks is not None:
        check_stacks(f"{kind}.stacks", stacks)
    cpu = b.get("cpu")
    if cpu is not None and not (type(cpu) is list and len(cpu) == 2 and all(type(x) is int and x >= 0 for x in cpu)):
        raise bad_body(f"{kind}.cpu must be [cpu_ns, runq_ns], two integers >= 0")


def check_stacks(name: str, stacks: Any) -> None:
    """Check sampled thread stacks: a list of ``{"thread": str, "frames": [str, ...]}``."""
    if type(stacks) is not list:
        raise wrong_type(name, stacks)
    for s in stacks:
        if not (type(s) is dict and type(s.get("thread")) is str and type(s.get("frames")) is list):
            raise bad_body(f"{name} entries need thread and frames")
