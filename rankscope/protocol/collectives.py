"""Each rank's collectives as its beats carry them (``beat`` body field ``coll``, optional).

The rank reads PyTorch's Flight Recorder (producers/collective_log.py) and sends, per process
group, the collectives recorded since its last beat::

    {"pg": "0", "size": 4,              # the recorder's group name and the group's rank count
     "seq": [41, 42], "op": [0, 0],     # collective sequence numbers; index into "ops"
     "reach_ns": [...],                 # when this rank reached the collective (wall ns)
     "dur_ns": [...],                   # how long it ran on this rank's device; -1 when not timed
     "ops": ["all_reduce float32[1000]"],
     "last": [enqueued, started, completed]}   # the group's last collective in each state; -1 unknown

``reach_ns`` is the recorder's ``time_created_ns``: when the collective was issued on the thread
that issued it. Where a collective blocks its caller (gloo), or is issued when the device gets to it
(a stream thread), that is when this rank arrived. With NCCL it is the host's enqueue time; there the
recorder's device durations (``TORCH_NCCL_ENABLE_TIMING``) tell who arrived last: a collective ends
at about the same time on every rank, so the rank that ran it shortest reached it last.
:func:`lateness` is the one rule for both. Sequence numbers count per group on every rank alike,
so ``(pg, seq)`` names the same collective on every member.
"""

from __future__ import annotations

from typing import Any

from rankscope.protocol.errors import WireError

MAX_GROUPS = 16          # process groups per beat
MAX_RECORDS = 512        # collectives per group per beat (a rank sends its newest)
MAX_OPS = 64             # distinct op labels per group per beat
MAX_OP_CHARS = 160
COLUMNS = ("seq", "op", "reach_ns", "dur_ns")


def op_label(profiling_name: str, sizes: Any, dtypes: Any) -> str:
    """ "all_reduce float32[1000]": the op without its backend prefix, each input's dtype and shape."""
    op = str(profiling_name).split(":", 1)[-1] or "unknown"
    parts = []
    for i, shape in enumerate(sizes if isinstance(sizes, list) else []):
        dtype = dtypes[i] if isinstance(dtypes, list) and i < len(dtypes) else "?"
        dims = ",".join(str(d) for d in shape) if isinstance(shape, list) else str(shape)
        parts.append(f"{dtype}[{dims}]")
    return f"{op} {' '.join(parts)}".strip()[:MAX_OP_CHARS]


def lateness(reach_ns: int, dur_ns: int) -> int:
    """A value that orders the members' arrivals at one collective (larger = later), and whose
    differences are the leads: the device duration, negated, where it was timed, else the reach time."""
    return -dur_ns if dur_ns >= 0 else reach_ns


def validate(coll: Any) -> None:
    """Check a beat's ``coll`` field. Raises WireError("bad_body", ...)."""
    if not isinstance(coll, list) or len(coll) > MAX_GROUPS:
        raise WireError("bad_body", f"beat.coll is not a list of at most {MAX_GROUPS} groups")
    for g in coll:
        if not isinstance(g, dict):
            raise WireError("bad_body", "beat.coll entry is not a map")
        pg, size, ops, last = g.get("pg"), g.get("size"), g.get("ops"), g.get("last")
        if not isinstance(pg, str) or len(pg) > 200 or type(size) is not int or size < 0:
            raise WireError("bad_body", "beat.coll entry needs pg (str) and size (int >= 0)")
        if not (isinstance(ops, list) and len(ops) <= MAX_OPS and all(isinstance(o, str) for o in ops)):
            raise WireError("bad_body", f"beat.coll.ops is not a list of at most {MAX_OPS} strings")
        if not (isinstance(last, list) and len(last) == 3 and all(type(x) is int for x in last)):
            raise WireError("bad_body", "beat.coll.last is not 3 integers")
        cols = [g.get(c) for c in COLUMNS]
        n = len(cols[0]) if isinstance(cols[0], list) else -1
        if n < 0 or n > MAX_RECORDS:
            raise WireError("bad_body", f"beat.coll.seq is not a list of at most {MAX_RECORDS} integers")
        for name, col in zip(COLUMNS, cols, strict=True):
            if not isinstance(col, list) or len(col) != n or not all(type(x) is int for x in col):
                raise WireError("bad_body", f"beat.coll.{name} is not {n} integers")
        if any(not 0 <= i < len(ops) for i in g["op"]):
            raise WireError("bad_body", "beat.coll.op indexes past ops")


def records(g: dict[str, Any]) -> list[tuple[int, int, int, str]]:
    """A validated group's collectives: ``(seq, reach_ns, dur_ns, op label)``."""
    ops = g["ops"]
    return [(s, r, d, ops[o]) for s, o, r, d in zip(g["seq"], g["op"], g["reach_ns"], g["dur_ns"], strict=True)]
