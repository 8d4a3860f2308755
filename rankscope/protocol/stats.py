"""``stats``: the processors' per-rank step statistics, one message per job per period.

Body::

    {"ranks": [{"rank": int32, "ts_ns": int, "step": int, "window_steps": int32,
                "median_step_ns": int, "p95_step_ns": int, "median_busy_ns": int, "median_comm_ns": int,
                "busy_z": number, "state": str,
                "cpu_wait": number}, ...]}                    # optional

Integers are Int64 unless marked int32. ``cpu_wait`` is, of the time in the rank's last 30 s its
training thread was ready to run, the share (0..1) it waited for a CPU, where the rank reports it (rankscope/protocol/steps.py ``cpu``).
"""

from __future__ import annotations

from typing import Any

from rankscope.protocol.errors import WireError, bad_body
from rankscope.protocol.fields import I32, I64, field, int_field, number_field, str_field

LO, HI = I64
LO32, HI32 = I32
# An entry's fields in the order of the worker_stats table's columns after ``job``.
ENTRY_FIELDS = ("rank", "ts_ns", "step", "window_steps", "median_step_ns", "p95_step_ns", "median_busy_ns",
                "median_comm_ns", "busy_z", "state")
INT32_FIELDS = frozenset({"rank", "window_steps"})


def check_stats(body: dict[str, Any]) -> None:
    """Check a ``stats`` body, every entry (they come by the thousand: each is checked in one expression)."""
    for i, e in enumerate(field("stats", body, "ranks", list)):
        try:
            r, ts, st, ws = e["rank"], e["ts_ns"], e["step"], e["window_steps"]
            med, p95, mb, mc = e["median_step_ns"], e["p95_step_ns"], e["median_busy_ns"], e["median_comm_ns"]
            bz, state = e["busy_z"], e["state"]
        except (KeyError, TypeError):
            raise _entry_error(i, e) from None
        tz = type(bz)
        if not (type(e) is dict and type(r) is int and LO32 <= r <= HI32 and type(ts) is int and LO <= ts <= HI
                and type(st) is int and LO <= st <= HI and type(ws) is int and LO32 <= ws <= HI32
                and type(med) is int and LO <= med <= HI and type(p95) is int and LO <= p95 <= HI
                and type(mb) is int and LO <= mb <= HI and type(mc) is int and LO <= mc <= HI
                and (tz is float or tz is int) and type(state) is str):
            raise _entry_error(i, e)
        cw = e.get("cpu_wait")
        if cw is not None and not ((type(cw) is float or type(cw) is int) and 0 <= cw <= 1):
            raise bad_body(f"stats.ranks[{i}].cpu_wait={cw!r} is not a share 0..1")


def _entry_error(i: int, e: Any) -> WireError:
    """The error naming the first bad field of entry ``i``."""
    if type(e) is not dict:
        return bad_body(f"stats.ranks[{i}] is {type(e).__name__}")
    for name in ENTRY_FIELDS:
        where = f"stats.ranks[{i}].{name}"
        if name not in e:
            return bad_body(f"{where} missing")
        try:
            if name == "busy_z":
                number_field(e[name], where)
            elif name == "state":
                str_field(e[name], where)
            else:
                int_field(e[name], where, I32 if name in INT32_FIELDS else I64)
        except WireError as err:
            return err
    return bad_body(f"stats.ranks[{i}] is malformed")
