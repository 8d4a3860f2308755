"""Shared by the dashboard's query modules: rank states, time helpers, argument checks."""

from __future__ import annotations

import time

import pandas as pd

from rankscope.sql_guard import READONLY_STATEMENTS as READONLY_STATEMENTS
from rankscope.sql_guard import SqlRefused as SqlRefused
from rankscope.sql_guard import check_readonly_sql as check_readonly_sql
from rankscope.sql_guard import readonly_settings as readonly_settings
from rankscope.storage.readonly import SqlResult as SqlResult
from rankscope.storage.readonly import run_readonly as run_readonly
from rankscope.storage.store import StoreError as StoreError

#: Above this many ranks the step-time chart becomes a rank x step heatmap.
HEATMAP_MIN_RANKS = 64


def now_or_wall_ns(now_ns: int | None) -> int:
    return time.time_ns() if now_ns is None else int(now_ns)


def as_datetime(ns: pd.Series) -> pd.Series:
    """Int64 ns -> tz-aware UTC timestamps; 0 (never) becomes NaT."""
    ns = ns.fillna(0).astype("int64")
    return pd.to_datetime(ns, unit="ns", utc=True).where(ns > 0)


def check_positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
