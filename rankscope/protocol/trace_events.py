"""``trace`` (v1): one chunk of a trace window's events, as the ranks send it and decode checks it.

A chunk carries a window's events: integer columns (:data:`WIRE_INT_COLUMNS`, packed bytes typed by
``column_types`` as :mod:`rankscope.packed` writes them, or int lists), its own ``categories``,
``names``, ``paths`` ([parent, name] pairs: Python call paths) and ``tids`` tables, ``t0_ns`` (start
times are ``t0_ns`` plus the cumulative ``start_delta_ns``) and sparse ``attrs`` (``[[row, map], ...]``;
a list of one map or nil per event in the list form). The ranks build chunks
(producers/trace_chunks.py). The columns past :data:`REQUIRED_INT_COLUMNS` are optional
(:data:`OPTIONAL_INT_COLUMNS`): a chunk without them, as ranks of earlier versions send, decodes
with their defaults.

Launch links: ``corr`` is the profiler's correlation id (0: none) of a runtime call and of the GPU
work it launched, and an op's own id on other host events; ``linked`` is, on GPU work, the id of the
op that launched it.

:func:`check_trace` is decode's check of the body's fields; rankscope/protocol/trace_rows.py
validates the events whole and resolves them into rows (it needs numpy; this module does not).
"""

from __future__ import annotations

from typing import Any

from rankscope.protocol.fields import field

#: Integer columns of a trace chunk on the wire.
WIRE_INT_COLUMNS = ("category", "name", "start_delta_ns", "dur_ns", "device", "stream", "step", "bytes", "corr",
                    "tid", "path", "linked")
#: The columns a chunk must carry.
REQUIRED_INT_COLUMNS = ("category", "name", "start_delta_ns", "dur_ns", "device", "stream", "step", "bytes", "path")
#: Columns a chunk may leave out, and the value each event then has (``tid``: no entry of ``tids``).
OPTIONAL_INT_COLUMNS = {"corr": 0, "tid": -1, "linked": 0}
#: Columns stored as Int32.
I32_COLUMNS = ("device", "stream")


def check_trace(body: dict[str, Any]) -> None:
    """Check a ``trace`` body's fields (decode); :func:`rankscope.protocol.trace_rows.decode_chunk`
    checks the events."""
    field("trace", body, "window_id", str)
    field("trace", body, "events", dict)
