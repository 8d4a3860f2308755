"""One rank's window summary body (the ``summary`` message) -> the frames the report reads. Pure.

Shared by the live window collector (``stream_processors/windows.py``) and the offline diagnosis
(``rankscope.offline.diagnosis``), so a recorded trace and a live window reach :func:`report.build_report` the
same way.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from rankscope.call_paths import expand_call_paths
from rankscope.protocol.trace_summary import thread_cpu

__all__ = ["summary_frames"]


def summary_frames(rank: int, body: dict[str, Any]) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """``(functions, arrivals)`` of one rank's summary body.

    ``functions``: one row per function (the summary's columns, Python call paths expanded to
    ``root;...;leaf`` names) with ``rank`` and ``window_ns``, and ``thread_cpu_ns`` and ``thread_runq_ns``
    when the body has the training thread's ``thread_cpu``; ``arrivals``: ``name, seq, start_ns,
    rank`` of the rank's collective calls, None without any. Raises ValueError on a malformed table.
    """
    functions = expand_call_paths(body["functions"])
    fn = pd.DataFrame({k: v for k, v in functions.items() if isinstance(v, list)})
    window_ns = body["functions"].get("window_ns") or (int(body.get("end_ns", 0)) - int(body.get("start_ns", 0)))
    fn["rank"] = rank
    fn["window_ns"] = int(window_ns)
    tc = thread_cpu(body)               # WireError, a ValueError, when malformed
    if tc is not None:
        fn["thread_cpu_ns"], fn["thread_runq_ns"] = tc
    arr = body.get("arrivals")
    arrivals = None
    if isinstance(arr, dict) and arr.get("name"):
        arrivals = pd.DataFrame(arr)
        arrivals["rank"] = rank
    return fn, arrivals
