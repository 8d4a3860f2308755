"""Keep the tracer's own threads out of the job's profiles.

torch.profiler's Python tracer (``with_stack``) hooks every thread's profile function when a window
starts. The tracer's background threads call :func:`leave_profiler` at the top of each loop turn:
their Python calls then neither appear in the job's window (reports and flame graphs show the job
alone) nor pay the hook's cost (~11k events a second for a busy thread; the hardware sampler at
100 ms inside a window cost the training thread ~10 ms per window on 2 shared cores). Frames that
were open when the window started still appear; producers/trace_extract.py ``without_threads``
leaves those out.
"""

from __future__ import annotations

import sys


def leave_profiler() -> None:
    """Remove the calling thread's profile hook (only ever called on the tracer's own threads)."""
    if sys.getprofile() is not None:
        sys.setprofile(None)
