"""The SQL console: saved queries and the schema; the guard and the run are shared (rankscope/sql_guard.py, storage/readonly.py)."""

from __future__ import annotations

import pandas as pd

from rankscope.sql_guard import DEFAULT_MAX_ROWS, DEFAULT_TIMEOUT_S
from rankscope.sql_guard import READONLY_STATEMENTS as READONLY_STATEMENTS
from rankscope.sql_guard import SqlRefused as SqlRefused
from rankscope.sql_guard import check_readonly_sql as check_readonly_sql
from rankscope.sql_guard import readonly_settings as readonly_settings
from rankscope.storage.readonly import SqlResult as SqlResult
from rankscope.storage.readonly import _session
from rankscope.storage.readonly import run_readonly as run_readonly
from rankscope.storage.store import Store
from rankscope.storage.store import StoreError as StoreError

# SQL console ------------------------------------------------------------------------------------------

# The guard and the read-only run live below the dashboard (rankscope/sql_guard.py, storage/readonly.py),
# shared with ``rankscope sql`` and serve's query endpoint.
CONSOLE_MAX_ROWS = DEFAULT_MAX_ROWS
CONSOLE_TIMEOUT_S = DEFAULT_TIMEOUT_S
_console_client = _session


#: Saved console queries; ``{db}`` is the database name.
SQL_EXAMPLES = {
    "Slowest ranks by median busy time (last 10 min)": """\
SELECT job, rank, any(host) AS host, uniqExact(step) AS steps,
       round(quantile(0.5)(busy_ns) / 1e6, 1) AS median_busy_ms,
       round(quantile(0.5)(duration_ns) / 1e6, 1) AS median_step_ms
FROM {db}.steps
WHERE end_ns >= toUnixTimestamp64Nano(now64(9) - INTERVAL 10 MINUTE)
GROUP BY job, rank
ORDER BY median_busy_ms DESC
LIMIT 20""",
    "Open alerts": """\
SELECT job, alert_id, kind, severity, ranks, step, summary,
       fromUnixTimestamp64Nano(opened_ns) AS opened
FROM (SELECT * FROM {db}.alerts ORDER BY version DESC LIMIT 1 BY job, alert_id)
WHERE status != 'resolved'
ORDER BY opened DESC""",
    "Steps per second per rank (last 5 min)": """\
SELECT job, rank, uniqExact(step) AS steps, round(steps / 300, 2) AS steps_per_s, max(step) AS last_step
FROM {db}.steps
WHERE end_ns >= toUnixTimestamp64Nano(now64(9) - INTERVAL 5 MINUTE)
GROUP BY job, rank
ORDER BY job, steps_per_s""",
    "Top functions by exclusive time in the latest window": """\
WITH (SELECT argMax((job, window_id), end_ns) FROM {db}.trace_windows) AS latest
SELECT category, name, uniqExact(rank) AS ranks, sum(count) AS calls,
       round(sum(exclusive_ns) / 1e6, 2) AS exclusive_ms, round(sum(total_ns) / 1e6, 2) AS total_ms
FROM {db}.function_summaries FINAL
WHERE (job, window_id) = latest
GROUP BY category, name
ORDER BY exclusive_ms DESC
LIMIT 25""",
}


def table_columns(store: Store) -> pd.DataFrame:
    """Tables and columns of the rankscope database (for the console's schema list)."""
    sql = """
        SELECT table, name, type FROM system.columns
        WHERE database = {db:String} AND table != 'schema_migrations'
        ORDER BY table, position
    """
    return store.query_df(sql, {"db": store.database})
