"""``profile``: one interval of a rank's sampled Python stacks, folded into call paths with counts.

A rank (producers/stack_sampler.py) samples every thread's stack ``hz`` times a second and, every
interval, sends the call paths it saw, outermost frame first, as the interned table of
rankscope/call_paths.py (``names``, ``paths = [[parent, name_idx], ...]``) and one row per
(call path, thread role) with its sample count. Only the most sampled paths fit; each role's
samples left out are counted in ``other`` so totals stay exact. The sender's process is the
envelope's ``pid`` (a DataLoader worker sends under its rank, with its own pid).

Body (v2)::

    {"t0_ns": int, "t1_ns": int, "hz": float, "ticks": int,
     "roles": [str, ...],                      # thread roles, ROLES
     "names": [str, ...], "paths": [[parent, name_idx], ...],   # parent: -1 or an earlier entry
     "path": [int, ...], "role": [int, ...], "count": [int, ...],   # rows
     "other": [int, ...]}                      # per role: samples not in the rows
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from rankscope.protocol.errors import bad_body

# Thread roles: the thread that calls tracer.step(); a DataLoader worker process; the DataLoader's
# pin-memory thread; any other Python thread of the process. rankscope's own threads are never sampled.
ROLES = ("training", "dataloader", "pin_memory", "other")
MAX_ROWS = 256            # call paths per message
MAX_NAMES = 4096          # distinct frames per message
MAX_NAME_CHARS = 300      # one frame's label
MAX_DEPTH = 128           # frames per call path
MAX_HZ = 1000.0
BYTES_PER_S = 2048        # the wire budget per rank: a message holds at most this times its interval
MAX_COUNT = 2**31 - 1     # samples of one row, and ticks


@dataclass(frozen=True)
class ProfileBody:
    t0_ns: int
    t1_ns: int
    hz: float
    ticks: int
    roles: list[str]
    names: list[str]
    paths: list[list[int]]
    path: list[int]
    role: list[int]
    count: list[int]
    other: list[int]


# Each field's type, checked exactly (a bool is not an int); lists by their items' type. Plain Python:
# the rank side decodes with nothing but msgpack installed.
_FIELDS: dict[str, tuple[type, type | None]] = {
    "t0_ns": (int, None), "t1_ns": (int, None), "hz": (float, None), "ticks": (int, None),
    "roles": (list, str), "names": (list, str), "paths": (list, list), "path": (list, int), "role": (list, int),
    "count": (list, int), "other": (list, int)}


def _typed(name: str, v: Any) -> bool:
    kind, item = _FIELDS[name]
    if kind is float:
        return type(v) is float or type(v) is int
    if type(v) is not kind:
        return False
    if item is None:
        return True
    items = cast(list[Any], v)
    if item is list:
        return True         # the call-path table's entries: checked with their bounds in validate
    return set(map(type, items)) <= {item}


def _table_ok(paths: list[Any], nnames: int) -> bool:
    """Every entry of the call-path table is ``[parent, name index]``: ints, the parent -1 or an
    earlier entry (so no cycle), the name index inside the names."""
    for i, entry in enumerate(paths):
        if type(entry) is not list or len(entry) != 2:
            return False
        parent, name_idx = entry
        if type(parent) is not int or type(name_idx) is not int or not -1 <= parent < i or not 0 <= name_idx < nnames:
            return False
    return True


def validate(body: dict[str, Any]) -> ProfileBody:
    """The body as a :class:`ProfileBody`, or WireError (``bad_body``) saying what is wrong."""
    for name in _FIELDS:
        if name not in body:
            raise bad_body(f"profile: {name} missing")
        if not _typed(name, body[name]):
            raise bad_body(f"profile: {name} has the wrong type")
    p = ProfileBody(**{name: body[name] for name in _FIELDS})
    if not (0 < p.t0_ns <= p.t1_ns and 0 < p.hz <= MAX_HZ and p.ticks >= 0):
        raise bad_body("profile: needs 0 < t0_ns <= t1_ns, 0 < hz <= 1000 and ticks >= 0")
    if len(p.roles) > len(ROLES) or any(r not in ROLES for r in p.roles) or len(p.other) != len(p.roles):
        raise bad_body(f"profile: roles must be of {ROLES}, with one 'other' count each")
    if len(p.names) > MAX_NAMES or any(len(n) > MAX_NAME_CHARS for n in p.names):
        raise bad_body(f"profile: at most {MAX_NAMES} names of {MAX_NAME_CHARS} characters")
    n = len(p.path)
    if n > MAX_ROWS or len(p.role) != n or len(p.count) != n:
        raise bad_body(f"profile: path, role and count are rows of equal length, at most {MAX_ROWS}")
    if not _table_ok(p.paths, len(p.names)):
        raise bad_body("profile: paths entries are [parent (-1 at a root, else an earlier entry), name index]")
    if p.path and (min(p.path) < 0 or max(p.path) >= len(p.paths) or min(p.role) < 0
                   or max(p.role) >= len(p.roles)):
        raise bad_body("profile: a row names a path or role outside its table")
    if (p.count and (min(p.count) <= 0 or max(p.count) > MAX_COUNT)) \
            or (p.other and (min(p.other) < 0 or max(p.other) > MAX_COUNT)) \
            or p.ticks > MAX_COUNT or p.t1_ns >= 2**63:
        raise bad_body("profile: counts are positive (others not negative), at most 2**31 - 1")
    return p


def from_validated(body: dict[str, Any]) -> ProfileBody:
    """The struct of a body :func:`validate` (or envelope.decode) has already accepted."""
    return ProfileBody(**{name: body[name] for name in _FIELDS})


def rows(p: ProfileBody) -> list[tuple[str, str, int]]:
    """(role, ``"root;...;leaf"``, count) for each row, and ``(role, "", other)`` for each role's
    samples left out, of a validated body. Raises WireError (``bad_body``) on a call path deeper than
    MAX_DEPTH."""
    from rankscope.call_paths import valid_leaf_strings

    try:
        strings = valid_leaf_strings(p.names, p.paths, set(p.path), max_depth=MAX_DEPTH)
    except ValueError as e:
        raise bad_body(str(e)) from None
    roles = p.roles
    out = [(roles[r], strings[pid], c) for pid, r, c in zip(p.path, p.role, p.count, strict=True)]
    out.extend((role, "", c) for role, c in zip(p.roles, p.other, strict=True) if c > 0)
    return out
