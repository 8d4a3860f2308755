"""``summary`` (v1): a rank's per-function table of a trace window and the window's bounds.

Body::

    {"window_id": str, "functions": {column: [...], ...}, "first_step": int, "last_step": int,
     "start_ns": int, "end_ns": int, "events_total": int, "events_sent": int, "truncated": bool,
     "status": str, "thread_cpu": [int, int]}

``thread_cpu`` (optional: ranks without ``/proc/<pid>/task/<tid>/schedstat`` and older ranks leave it
out) is the training thread's time on a CPU and its run-queue wait (runnable, waiting for a CPU)
over the window, in ns: the report tells a worker slowed by its host from one slowed by its work.

``functions`` holds ``category`` and ``name`` (Python call paths as the interned table of
rankscope/call_paths.py) and the integer columns :data:`SUMMARY_INT_COLUMNS`. The ranks build the
body with :func:`summary_body`; :func:`check_summary` is decode's check of its fields and
:func:`decode_summary` validates it whole for storage.
"""

from __future__ import annotations

from typing import Any

from rankscope.call_paths import expand_call_paths
from rankscope.protocol.errors import bad_body
from rankscope.protocol.fields import field, int_field, int_list, str_field, str_list

#: Integer columns of a summary's functions table.
SUMMARY_INT_COLUMNS = ("count", "total_ns", "median_ns", "p95_ns", "max_ns", "exclusive_ns")


def check_summary(body: dict[str, Any]) -> None:
    """Check a ``summary`` body's fields (decode); :func:`decode_summary` checks the rest."""
    field("summary", body, "window_id", str)
    field("summary", body, "functions", dict)
    thread_cpu(body)


def thread_cpu(body: dict[str, Any]) -> tuple[int, int] | None:
    """A summary body's ``thread_cpu`` as ``(cpu_ns, runq_ns)``, None when absent; raises WireError
    when it is not two non-negative integers."""
    tc = body.get("thread_cpu")
    if tc is None:
        return None
    cpu, runq = int_list(tc, "summary.thread_cpu", 2, (0, 2**63 - 1))
    return cpu, runq


def summary_body(col: dict[str, Any], functions: dict[str, Any], *, events_sent: int, truncated: bool,
                 status: str = "done") -> dict[str, Any]:
    """The body of a ``summary`` message for a window (``col``: its columnar events and bounds;
    ``functions``: its per-function table, producers/trace_summary.py ``summarize``)."""
    return {"window_id": col["window_id"], "functions": functions, "first_step": int(col["first_step"]),
            "last_step": int(col["last_step"]), "start_ns": int(col["start_ns"]), "end_ns": int(col["end_ns"]),
            "events_total": len(col["events"]["category"]), "events_sent": int(events_sent),
            "truncated": bool(truncated), "status": status}


def decode_summary(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(functions, window)`` of one ``summary`` body, validated: ``functions`` holds ``category``
    and ``name`` (call paths expanded to ``root;...;leaf``), :data:`SUMMARY_INT_COLUMNS`, ``n`` and
    ``window_ns``; ``window`` holds ``window_id``, ``status``, ``first_step``, ``last_step``,
    ``start_ns``, ``end_ns``, ``events`` (events sent: the rows the window should have),
    ``truncated``, and ``thread_cpu_ns`` and ``thread_runq_ns`` (:func:`thread_cpu`; -1 when the rank
    does not send them). Raises WireError on any malformed part."""
    window_id = str_field(body.get("window_id"), "summary.window_id")
    if not isinstance(body.get("functions"), dict):
        raise bad_body("summary.functions must be a map of columns")
    try:
        f = expand_call_paths(body["functions"])
    except (TypeError, ValueError) as e:
        raise bad_body(f"summary.functions: {e}") from None
    cats = str_list(f.get("category"), "summary.functions.category")
    n = len(cats)
    fnames = str_list(f.get("name"), "summary.functions.name")
    if len(fnames) != n:
        raise bad_body(f"summary.functions.name has {len(fnames)} values, category has {n}")
    cols = {c: int_list(f.get(c), f"summary.functions.{c}", n) for c in SUMMARY_INT_COLUMNS}
    start_ns = int_field(body.get("start_ns"), "summary.start_ns")
    end_ns = int_field(body.get("end_ns"), "summary.end_ns")
    window_ns = int_field(f.get("window_ns", end_ns - start_ns), "summary.functions.window_ns")
    truncated = body.get("truncated", False)
    if not isinstance(truncated, bool):
        raise bad_body(f"summary.truncated is {type(truncated).__name__}, expected bool")
    cpu_ns, runq_ns = thread_cpu(body) or (-1, -1)
    window = {"window_id": window_id, "status": str_field(body.get("status", "done"), "summary.status"),
              "first_step": int_field(body.get("first_step", -1), "summary.first_step"),
              "last_step": int_field(body.get("last_step", -1), "summary.last_step"),
              "start_ns": start_ns, "end_ns": end_ns,
              "events": int_field(body.get("events_sent", body.get("events_total", 0)), "summary.events_sent"),
              "truncated": truncated, "thread_cpu_ns": cpu_ns, "thread_runq_ns": runq_ns}
    return {"category": cats, "name": fnames, "n": n, "window_ns": window_ns, **cols}, window
