"""Diagnosis reports as stored (the ``reports`` table, one row per job and window, written by the
sink from the reports topic). A pure query over a Store, read by ``rankscope report``; the
dashboard's Reports page lists them (dashboard/queries/reports.py)."""

from __future__ import annotations

import json
from typing import Any

from rankscope.storage.store import Store


def latest_report(store: Store, job: str, window_prefix: str = "") -> dict[str, Any] | None:
    """The newest stored report of ``job`` whose window id starts with ``window_prefix`` (a window id,
    or the request id its windows are named after; "" for any), as the processors published it, or
    None. A stored body that is not a JSON object (no sink writes one) is reported as None too."""
    sql = f"""
        SELECT body FROM {store.database}.reports
        WHERE job = {{job:String}} AND startsWith(window_id, {{prefix:String}})
        ORDER BY created_ns DESC LIMIT 1
    """
    rows = store.query_rows(sql, {"job": job, "prefix": window_prefix})
    if not rows:
        return None
    try:
        body = json.loads(rows[0][0])
    except (TypeError, ValueError):
        return None
    return body if isinstance(body, dict) else None
