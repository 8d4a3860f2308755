"""Shared by the dashboard's query modules: rank states, time helpers, argument checks."""

from __future__ import annotations

import time

from rankscope.sql_guard import READONLY_STATEMENTS as READONLY_STATEMENTS
from rankscope.sql_guard import SqlRefused as SqlRefused
from rankscope.sql_guard import check_readonly_sql as check_readonly_sql
from rankscope.sql_guard import readonly_settings as readonly_settings
from rankscope.storage.frames import as_datetime as as_datetime
from rankscope.storage.frames import check_positive as check_positive
from rankscope.storage.readonly import SqlResult as SqlResult
from rankscope.storage.readonly import run_readonly as run_readonly
from rankscope.storage.store import StoreError as StoreError

#: Above this many ranks the step-time chart becomes a rank x step heatmap.
HEATMAP_MIN_RANKS = 64


def now_or_wall_ns(now_ns: int | None) -> int:
    return time.time_ns() if now_ns is None else int(now_ns)


