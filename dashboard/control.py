"""Trace-window requests from the dashboard, and the ranks' acknowledgements.

:func:`request_window` sends a :class:`~rankscope.trace_request.TraceRequest` through the loop
``rankscope trace`` runs too (:class:`rankscope.trace_client.WindowRequest`: the same start step and
period for the same job progress, read from the stats topic) and collects the ranks' acks for a few
seconds. No Streamlit here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from rankscope.config import Settings
from rankscope.control_io import latest_stats
from rankscope.trace_client import Ack, WindowRequest
from rankscope.trace_request import MODE_LABELS, MODES, TraceRequest, parse_ranks, stalled_note

ACK_WAIT_S = 5.0

__all__ = ["ACK_WAIT_S", "MODES", "MODE_LABELS", "Ack", "TraceRequest", "parse_ranks",
           "request_window", "stalled_note"]


def request_window(settings: Settings, req: TraceRequest, wait_s: float = ACK_WAIT_S,
                   expect_ranks: Iterable[int] | None = None, progress: list[dict[str, Any]] | None = None,
                   consumer_factory: Callable[[dict[str, Any]], Any] | None = None,
                   producer_factory: Callable[[dict[str, Any]], Any] | None = None) -> list[Ack]:
    """Send ``req`` to the control topic and return the acks read from the replies topic within ``wait_s`` seconds.

    Blocks for up to ``wait_s`` (plus broker round trips); returns early once every rank of
    ``expect_ranks`` has answered. ``progress`` (per rank: step, ts_ns, median_step_ns) plans the
    start step and period; None reads it from the stats topic, as the CLI does. Raises RuntimeError
    when the topic is missing or the request cannot be delivered (with the bootstrap address).
    """
    expect = set(expect_ranks) if expect_ranks is not None else None
    with WindowRequest(settings, req, "dashboard", reader_timeout_s=5, consumer_factory=consumer_factory,
                       producer_factory=producer_factory) as w:
        if progress is None:
            progress = latest_stats(settings, timeout_s=3.0).get(req.job, [])
        w.send(progress)
        acks: list[Ack] = []
        for ack in w.acks(time.monotonic() + wait_s):
            acks.append(ack)
            if expect is not None and expect <= {a.rank for a in acks}:
                break
        return acks
