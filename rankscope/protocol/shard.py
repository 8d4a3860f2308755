"""``shard`` (v2): the processors' own per-partition job summary (stream_processors/shard_summary.py
builds it and reads it back), its fields and bounds.

Body::

    {"shard": int, "ts_ns": int,
     "agg": {AGG_INTS...: int, "step_hist": {...}, "busy_hist": {...},
             "arrivals": [[step, arrival_ns, rank, gap_ns, dur_ns], ...],     # optional
             "cpu_wait": {"hist": {bin: count}, "top": [[rank, wait, cpu], ...]}, # optional
             "coll": {pg: {...}, ...}},                                       # optional
     "rows": [[ROW_TYPES...], ...],                # ranks a rule may name
     "stacks": {signature: [count, waiting, [frame, ...], [rank, ...]], ...},
     "failures": [[FAILURE_TYPES...], ...],        # optional
     "profiles": {"names": [path, ...], "ranks": [[rank, t1_ns, [name index, ...], [share per mille, ...]], ...]}}

A summary's encoded size stays under :data:`MAX_SUMMARY_BYTES` whatever the job size.
:func:`check_shard` is decode's check of the body's fields; :func:`check_summary` checks inside
them, :func:`check_profiles` the profile digests, :func:`arrival_rows`, :func:`coll_groups` and
:func:`cpu_wait` the job-wide rules' rows in ``agg``. Each raises WireError("bad_body").

``cpu_wait`` describes the live ranks' training threads over their last 30 s: ``hist`` counts ranks
by wait share (of its ready time, the share it waited for a CPU; bin = share per mille //
CPU_WAIT_BIN), ``top`` lists the ranks that waited most, with their wait share and their CPU time's
share of the whole time, per mille.
"""

from __future__ import annotations

from typing import Any

from rankscope.protocol.errors import bad_body
from rankscope.protocol.fields import field

MAX_SUMMARY_BYTES = 60_000
MAX_ARRIVAL_ROWS = 2048      # agg.arrivals rows
MAX_COLL_GROUPS = 4          # agg.coll groups
MAX_COLL_ROWS = 4096         # agg.coll rows per group
MAX_COLL_MISMATCHES = 4      # agg.coll mismatches per group
MAX_PROFILE_PATHS = 8        # call paths per rank in profiles
MAX_SHARE = 1000             # a profile share, per mille
MAX_CPU_WAIT_TOP = 16        # agg.cpu_wait.top rows
CPU_WAIT_BIN = 50            # agg.cpu_wait.hist bin width, per mille

NUMBER = (int, float)
# A row's fields (stream_processors/shard_summary.py Row): rank, host, pid, last_step,
# last_step_end_ns, hb_ns, hb_since_s, step_med_ns, busy_med_ns, window_steps, stack_sig, waiting,
# exit_reason, exit_detail, dropped.
ROW_TYPES: tuple[Any, ...] = (int, str, int, int, int, int, NUMBER, int, int, int, str, int, str, str, int)
# A failure's fields (shard_summary.py Failure): rank, host, pid, exit_ns, step, reason, exc_type, detail, frames.
FAILURE_TYPES: tuple[Any, ...] = (int, str, int, int, int, str, str, str, list)
AGG_INTS = ("ranks", "live", "exited", "crashed", "silent", "world_size", "min_step", "max_step",
            "max_step_end_ns", "max_step_med_ns", "newest_hb_ns", "busy_n", "retired")
AGG_HISTS = ("step_hist", "busy_hist")
COLL_GROUP_INTS = ("passed", "members", "size", "reached_max")


def check_shard(body: dict[str, Any]) -> None:
    """Check a ``shard`` body's fields (decode); :func:`check_summary` checks inside them."""
    field("shard", body, "shard", int)
    field("shard", body, "ts_ns", int)
    field("shard", body, "agg", dict)
    field("shard", body, "rows", list)
    field("shard", body, "stacks", dict)


def check_summary(body: dict[str, Any]) -> None:
    """Check a decoded ``shard`` body's rows, stacks, failures and agg (the profiles:
    :func:`check_profiles`, which stream_processors/profile_digest.py ``unpack`` runs)."""
    for raw in body["rows"]:
        _check_record("shard.rows", raw, ROW_TYPES)
    for raw in body["stacks"].values():
        if not (type(raw) is list and len(raw) == 4 and type(raw[0]) is int and type(raw[1]) is bool
                and type(raw[2]) is list and all(type(f) is str for f in raw[2])
                and type(raw[3]) is list and all(type(r) is int for r in raw[3])):
            raise bad_body("shard.stacks entry has the wrong shape")
    failures = body.get("failures", [])
    if type(failures) is not list:
        raise bad_body("shard.failures is not a list")
    for raw in failures:
        _check_record("shard.failures", raw, FAILURE_TYPES)
        if not all(type(f) is str for f in raw[-1]):
            raise bad_body("shard.failures frames are not strings")
    agg = body["agg"]
    for name in AGG_INTS:
        if type(agg.get(name)) is not int:
            raise bad_body(f"shard.agg.{name} missing or not an integer")
    for name in AGG_HISTS:
        if type(agg.get(name)) is not dict:
            raise bad_body(f"shard.agg.{name} missing")


def _check_record(name: str, raw: Any, types: tuple[Any, ...]) -> None:
    if type(raw) is not list or len(raw) != len(types):
        raise bad_body(f"{name} entry has the wrong shape")
    for v, t in zip(raw, types, strict=True):
        if not (type(v) in t if type(t) is tuple else type(v) is t):
            raise bad_body(f"{name} value {v!r} is not {t}")


def check_profiles(raw: Any) -> None:
    """Check a summary's ``profiles``: the ranks' digests (stream_processors/profile_digest.py)."""
    if not (type(raw) is dict and type(raw.get("names")) is list and type(raw.get("ranks")) is list):
        raise bad_body("shard.profiles must be {names: [...], ranks: [...]}")
    names = raw["names"]
    if not all(type(n) is str for n in names):
        raise bad_body("shard.profiles.names holds a non-string")
    for r in raw["ranks"]:
        if not (type(r) is list and len(r) == 4 and type(r[0]) is int and type(r[1]) is int
                and type(r[2]) is list and type(r[3]) is list and len(r[2]) == len(r[3])
                and len(r[2]) <= MAX_PROFILE_PATHS):
            raise bad_body("shard.profiles.ranks entries are [rank, t1_ns, [path index, ...], [share per mille, ...]]")
        if not all(type(i) is int and 0 <= i < len(names) for i in r[2]) or \
                not all(type(s) is int and 0 <= s <= MAX_SHARE for s in r[3]):
            raise bad_body("shard.profiles.ranks holds an index outside names or a share outside 0..1000")


def arrival_rows(agg: dict[str, Any]) -> list[tuple[int, int, int, int, int]]:
    """The ``arrivals`` rows of a summary's ``agg`` (step, arrival_ns, rank, gap_ns, dur_ns), checked;
    none when absent."""
    raw = agg.get("arrivals", [])
    if type(raw) is not list or len(raw) > MAX_ARRIVAL_ROWS:
        raise bad_body(f"shard.agg.arrivals is not a list of at most {MAX_ARRIVAL_ROWS} rows")
    out = []
    for row in raw:
        if not (type(row) is list and len(row) == 5 and all(type(v) is int for v in row)):
            raise bad_body(f"shard.agg.arrivals row {row!r} is not 5 integers")
        s, a, r, gap, dur = row
        out.append((s, a, r, gap, dur))
    return out


def cpu_wait(agg: dict[str, Any]) -> tuple[dict[int, int], list[tuple[int, int, int]]]:
    """A summary's ``agg["cpu_wait"]``, checked: (hist, top rows (rank, wait, cpu per mille)); empty
    when absent."""
    raw = agg.get("cpu_wait")
    if raw is None:
        return {}, []
    hist, top = (raw.get("hist"), raw.get("top")) if type(raw) is dict else (None, None)
    if not (type(hist) is dict and all(type(k) is int and 0 <= k <= MAX_SHARE // CPU_WAIT_BIN and type(v) is int
                                       and v > 0 for k, v in hist.items())):
        raise bad_body("shard.agg.cpu_wait.hist must map bins 0..20 to counts")
    if not (type(top) is list and len(top) <= MAX_CPU_WAIT_TOP
            and all(type(r) is list and len(r) == 3 and all(type(x) is int for x in r)
                    and 0 <= r[1] <= MAX_SHARE and 0 <= r[2] <= MAX_SHARE for r in top)):
        raise bad_body(f"shard.agg.cpu_wait.top must be at most {MAX_CPU_WAIT_TOP} rows [rank, wait, cpu] per mille")
    return hist, [(r[0], r[1], r[2]) for r in top]


def coll_groups(agg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A summary's ``agg["coll"]``, checked: per process group ``passed``, ``members``, ``size``,
    ``reached_max`` (ints), ``rows`` ([seq, late, rank, gap, event_ns, label crc]), ``lowest``
    ([rank, seq]), ``mismatches`` ([seq, [[crc, ranks, a rank], ...]]), ``labels`` and
    ``top_label``; empty when absent."""
    raw = agg.get("coll", {})
    if type(raw) is not dict or len(raw) > MAX_COLL_GROUPS:
        raise bad_body(f"shard.agg.coll is not a map of at most {MAX_COLL_GROUPS} groups")
    for name, g in raw.items():
        if not (type(name) is str and type(g) is dict and _coll_group_ok(g)):
            raise bad_body(f"shard.agg.coll[{name!r}] has the wrong shape")
    return raw


def _coll_group_ok(g: dict[str, Any]) -> bool:
    rows, lowest, mismatches = g.get("rows"), g.get("lowest"), g.get("mismatches")
    return (all(type(g.get(k)) is int for k in COLL_GROUP_INTS)
            and type(rows) is list and len(rows) <= MAX_COLL_ROWS and all(_ints(r, 6) for r in rows)
            and type(lowest) is list and all(_ints(x, 2) for x in lowest)
            and type(mismatches) is list and len(mismatches) <= MAX_COLL_MISMATCHES
            and all(type(m) is list and len(m) == 2 and type(m[0]) is int and type(m[1]) is list
                    and all(_ints(v, 3) for v in m[1]) for m in mismatches)
            and type(g.get("labels")) is dict and type(g.get("top_label", "")) is str)


def _ints(x: Any, n: int) -> bool:
    return type(x) is list and len(x) == n and all(type(v) is int for v in x)
