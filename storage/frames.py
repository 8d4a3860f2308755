"""Helpers for query functions over a Store: stored nanoseconds as timestamps, argument checks."""

from __future__ import annotations

import pandas as pd


def as_datetime(ns: pd.Series) -> pd.Series:
    """Int64 ns -> tz-aware UTC timestamps; 0 (never) becomes NaT."""
    ns = ns.fillna(0).astype("int64")
    return pd.to_datetime(ns, unit="ns", utc=True).where(ns > 0)


def check_positive(name: str, value: float) -> None:
    """Raise ValueError naming ``name`` unless ``value`` > 0."""
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
