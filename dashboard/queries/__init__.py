"""Every SQL statement the dashboard runs, as functions from a Store (and parameters) to DataFrames.

Contract shared by all functions here:

- They block until ClickHouse answers and raise :class:`rankscope.storage.store.StoreError` on failure.
- Values are bound server-side with ClickHouse's ``{name:Type}`` parameters (chDB and the HTTP
  server both support them); nothing user-controlled is formatted into SQL. Only the database
  name (from the Store, not from the user) is interpolated.
- Times in arguments are Int64 nanoseconds since the Unix epoch; ``now_ns`` defaults to the wall
  clock so tests can pin it. Durations in results are milliseconds (``*_ms``) or seconds (``*_s``).
- Tables are ReplacingMergeTree, so "latest" values use ``argMax(..., version/time)`` or
  ``LIMIT 1 BY``; merges never need to have happened for the answers to be exact.
- An empty result is an empty DataFrame with the documented columns.
- The SQL console (:func:`run_readonly`, from storage/readonly.py) is the one place here where
  user-written SQL runs: checked by :func:`check_readonly_sql` (rankscope/sql_guard.py), then run
  with ``readonly=1`` and result/time limits on a session of its own.

The trace-window queries live in storage/windows.py (``rankscope export`` reads them too) and are
re-exported here. No Streamlit here: the pages own caching and rendering.
"""

from __future__ import annotations

from rankscope.dashboard.queries.alerts import (  # noqa: F401
    ALERTS_COLUMNS,
    COLLECTIVE_COLUMNS,
    LOST_COLUMNS,
    STACK_COLUMNS,
    alert_stack_groups,
    alerts,
    incident_collectives,
    lost_time,
    parse_stack_groups,
)
from rankscope.dashboard.queries.common import HEATMAP_MIN_RANKS  # noqa: F401
from rankscope.dashboard.queries.console import (  # noqa: F401
    CONSOLE_MAX_ROWS,
    CONSOLE_TIMEOUT_S,
    SQL_EXAMPLES,
    _console_client,
    table_columns,
)
from rankscope.dashboard.queries.fleet import (  # noqa: F401
    BUCKETS_S,
    GPU_SUMMARY_COLUMNS,
    GPU_UTIL_COLUMNS,
    HOSTS_COLUMNS,
    HW_COLUMNS,
    HW_LATEST_COLUMNS,
    bucket_for,
    gpu_util_series,
    gpu_util_summary,
    host_names,
    hosts,
    hw_latest,
    hw_series,
)
from rankscope.dashboard.queries.jobs import (  # noqa: F401
    FLIGHT_COLUMNS,
    HEATMAP_METRICS,
    HEATMAP_WORST,
    JOBS_COLUMNS,
    RANKS_COLUMNS,
    STEP_COLUMNS,
    derive_rank_states,
    flight_records,
    jobs,
    lost_rank_seconds,
    rank_rows,
    ranks,
    slow_watch,
    step_time_heatmap,
    step_time_heatmaps,
    step_times,
)
from rankscope.dashboard.queries.reports import (  # noqa: F401
    REPORTS_COLUMNS,
    ReportSection,
    report_headline,
    report_sections,
    reports,
)
from rankscope.sql_guard import (  # noqa: F401
    READONLY_STATEMENTS,
    SqlRefused,
    check_readonly_sql,
    readonly_settings,
)
from rankscope.storage.profiles import path_seconds, profile_rows, rank_path_seconds  # noqa: F401
from rankscope.storage.readonly import SqlResult, run_readonly  # noqa: F401
from rankscope.storage.store import StoreError  # noqa: F401
from rankscope.storage.windows import (  # noqa: F401
    EVENT_COLUMNS,
    MAX_EVENTS,
    PYTHON_PATH_COLUMNS,
    WINDOW_RANKS_COLUMNS,
    WINDOWS_COLUMNS,
    trace_events,
    trace_window_ranks,
    trace_windows,
    window_event_ranks,
    window_python_paths,
)
