"""One finished trace window -> compact columnar records, an on-rank summary, byte-budgeted chunks.

Pipeline (all on the rank, after the profiler stopped)::

    raw = extract_raw(prof)               # producers/trace_extract.py: KinetoEvents -> column lists
    col = to_columnar(raw, window_id, first_step)   # numpy columns, steps, python call paths
    functions = summarize(col)            # per (category, name): count, total, median, p95, max, exclusive
    bodies, truncated, sent = chunk(col, byte_budget)   # "trace" message bodies (packed int columns)
    summary = summary_body(col, functions, events_sent=sent, truncated=truncated)  # "summary" body

``to_columnar`` also takes a list of event dicts (the offline reader's output, tests); see
producers/trace_extract.py for the dict format and the clock, producers/categories.py for the
categories.
"""

from __future__ import annotations

from rankscope.call_paths import expand_call_paths, path_strings  # noqa: F401

# The pipeline's API, one import for its users (the modules hold one step each).
from rankscope.producers.categories import (  # noqa: F401
    ANNOTATION,
    CAT,
    CATEGORIES,
    COLLECTIVE,
    CPU_OP,
    GPU_WORK,
    KERNEL,
    MEMCPY,
    MEMSET,
    PYTHON,
    RUNTIME,
)
from rankscope.producers.trace_chunks import chunk  # noqa: F401
from rankscope.producers.trace_columnar import (  # noqa: F401
    EVENT_COLUMNS,
    STEP_RE,
    TIER_OF_CATEGORY,
    call_paths,
    to_columnar,
)
from rankscope.producers.trace_extract import (  # noqa: F401
    RawEvents,
    detect_clock_offset_ns,
    experimental_config,
    extract_raw,
    frame_parents,
)
from rankscope.producers.trace_summary import (  # noqa: F401
    NATIVE_CODES,
    SUMMARY_COLUMNS,
    exclusive_times,
    group_stats,
    summarize,
)
from rankscope.protocol.trace_events import WIRE_INT_COLUMNS  # noqa: F401
from rankscope.protocol.trace_rows import chunk_columns  # noqa: F401
from rankscope.protocol.trace_summary import summary_body  # noqa: F401
