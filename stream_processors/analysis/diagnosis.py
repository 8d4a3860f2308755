"""The window diagnosis (slow workers, causes, collective arrivals, PerfTracker's sections) from
per-rank summary frames, live or recorded.

The live window collector (``stream_processors/windows.py``) and the offline diagnosis
(``rankscope.offline.diagnosis``) run the same steps on each rank's summary body:

1. :func:`summaries.summary_frames` turns it into frames;
2. :func:`report_from_frames` builds the report (``report.build_report``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from rankscope.stream_processors.analysis.report import build_report

__all__ = ["report_from_frames"]


def report_from_frames(frames: Mapping[int, pd.DataFrame], arrivals: Mapping[int, pd.DataFrame], *, job: str,
                       window_id: str, world_size: int | None, expected_ranks: list[int] | None) -> dict[str, Any]:
    """The report over per-rank function frames and arrival frames (:func:`summaries.summary_frames`)."""
    df = pd.concat([frames[r] for r in sorted(frames)], ignore_index=True)
    arr = pd.concat([arrivals[r] for r in sorted(arrivals)], ignore_index=True) if arrivals else None
    return build_report(df, arr, job=job, window_id=window_id, world_size=world_size, expected_ranks=expected_ranks)
