"""The window diagnosis of recorded traces, built as the live pipeline builds it:

1. each rank's events are summarised by the ranks' own summarizer (``rankscope.producers.trace_events``:
   :func:`rank_summary` runs it on a recorded trace, as ``rankscope replay`` does before shipping
   the summary);
2. the summary body goes through the wire codec (:func:`rankscope.protocol.envelope.encode` / ``decode``), as a
   live summary does on its way through Kafka;
3. :func:`diagnose_summaries` turns the bodies into frames (``summaries.summary_frames``) and the
   report (``diagnosis.report_from_frames``), the live window collector's shared analyzers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from rankscope.offline.kineto import Trace
from rankscope.offline.replay import epoch_base_ns, event_dicts
from rankscope.protocol.envelope import Envelope, decode, encode
from rankscope.stream_processors.analysis.diagnosis import report_from_frames
from rankscope.stream_processors.analysis.summaries import summary_frames

__all__ = ["OFFLINE_WINDOW", "diagnose_summaries", "rank_summary"]

OFFLINE_WINDOW = "offline-0"


def rank_summary(trace: Trace, window_id: str = OFFLINE_WINDOW) -> dict[str, Any]:
    """The ``summary`` body a rank would send for ``trace`` as one window (with collective
    arrivals), read back through the wire codec. ``trace`` must be loaded with
    ``extra_columns=True`` (Python stacks, memcpy bytes). Raises ValueError when nothing in it is
    replayable."""
    # The rank's summarizer itself, so offline numbers are the live pipeline's.
    from rankscope.producers.trace_events import summarize, summary_body, to_columnar
    from rankscope.producers.trace_window import collective_arrivals

    events = event_dicts(trace.events, offset_ns=epoch_base_ns(trace.metadata))
    if not events:
        raise ValueError(f"{trace.path}: no kernel, memcpy, runtime, op, python or annotation events")
    cols = to_columnar(events, window_id, None)
    body = summary_body(cols, summarize(cols, compact_paths=True), events_sent=len(events), truncated=False,
                        status="complete")
    body.update(request_id=window_id.rsplit("-", 1)[0], request_ranks=None, arrivals=collective_arrivals(cols))
    env = Envelope(kind="summary", job="offline", rank=trace.rank, host="offline", pid=0, seq=1, sent_ns=0, body=body)
    return decode(encode(env)).body


def diagnose_summaries(bodies: Mapping[int, dict[str, Any]], *, job: str = "", window_id: str = OFFLINE_WINDOW,
                       world_size: int | None = None) -> dict[str, Any]:
    """The report over ``{rank: summary body}`` (:func:`rank_summary`), with each rank's steps.

    ``world_size`` None means the ranks given (as for a replayed window, whose job has no live
    ranks). Raises ValueError on no bodies or malformed ones."""
    if not bodies:
        raise ValueError("no summaries to diagnose")
    frames: dict[int, pd.DataFrame] = {}
    arrivals: dict[int, pd.DataFrame] = {}
    for rank, body in bodies.items():
        fn, arr = summary_frames(int(rank), body)
        frames[int(rank)] = fn
        if arr is not None:
            arrivals[int(rank)] = arr
    report = report_from_frames(frames, arrivals, job=job, window_id=window_id, world_size=world_size,
                                expected_ranks=None)
    report["steps"] = {str(r): [bodies[r].get("first_step"), bodies[r].get("last_step")] for r in sorted(bodies)}
    return report
