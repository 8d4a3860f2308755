"""Diagnosis reports: the list, the headline, and a report's sections as tables."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pandas as pd

from rankscope.dashboard.queries.common import as_datetime, check_positive
from rankscope.sql_guard import READONLY_STATEMENTS as READONLY_STATEMENTS
from rankscope.sql_guard import SqlRefused as SqlRefused
from rankscope.sql_guard import check_readonly_sql as check_readonly_sql
from rankscope.sql_guard import readonly_settings as readonly_settings
from rankscope.storage.readonly import SqlResult as SqlResult
from rankscope.storage.readonly import run_readonly as run_readonly
from rankscope.storage.store import Store
from rankscope.storage.store import StoreError as StoreError

# Reports --------------------------------------------------------------------------------------------

REPORTS_COLUMNS = ["job", "window_id", "created", "created_ns", "body"]


def reports(store: Store, job: str | None = None, limit: int = 200) -> pd.DataFrame:
    """Diagnosis reports (latest per job and window), newest first: :data:`REPORTS_COLUMNS`."""
    check_positive("limit", limit)
    db = store.database
    sql = f"""
        SELECT toString(job) AS job, window_id, created_ns, body
        FROM {db}.reports
        WHERE {{job:String}} = '' OR job = {{job:String}}
        ORDER BY created_ns DESC LIMIT 1 BY job, window_id
        LIMIT {{limit:UInt32}}
    """
    df = store.query_df(sql, {"job": job or "", "limit": int(limit)})
    if df.empty:
        return pd.DataFrame(columns=REPORTS_COLUMNS)
    df["created"] = as_datetime(df["created_ns"])
    return df[REPORTS_COLUMNS].reset_index(drop=True)


def report_headline(body: str | bytes | dict[str, Any]) -> str:
    """The verdict's headline of a report body (:func:`rankscope.report_view.verdict`), or what
    the body is when it holds no diagnosis. Pure; never raises."""
    from rankscope.report_view import diagnosis_of, verdict

    try:
        obj = body if isinstance(body, dict) else json.loads(body)
    except (TypeError, ValueError):
        return "not JSON"
    if not isinstance(obj, dict):
        return "not a report"
    if diagnosis_of(obj) is None:
        return "GPU time breakdown (no diagnosis)" if "temporal_breakdown" in obj else "no diagnosis"
    try:
        return verdict(obj).headline
    except (KeyError, TypeError, ValueError) as e:
        return f"unreadable diagnosis ({type(e).__name__}: {e})"


@dataclass(frozen=True)
class ReportSection:
    """One part of a report body: ``kind`` is ``table`` (a DataFrame), ``fields`` (a two-column
    DataFrame of name and value) or ``json`` (any JSON value that is neither)."""

    title: str
    kind: str
    data: Any


def report_sections(body: str | bytes | dict[str, Any]) -> list[ReportSection]:
    """Split a report's JSON body into renderable sections. Pure; never raises.

    Steps: 1. parse (a body that is not JSON becomes one ``json`` section holding the text);
    2. top-level scalars and lists of scalars gather into a first ``Summary`` fields section;
    3. a list of dicts becomes a table (nested values as JSON text); 4. a dict holding lists of
    dicts is split into sub-sections titled ``parent / key``; any other dict becomes fields.
    """
    if isinstance(body, dict):
        obj: Any = body
    else:
        try:
            obj = json.loads(body)
        except (TypeError, ValueError):
            return [ReportSection("Body (not JSON)", "json", body.decode(errors="replace")
                                  if isinstance(body, bytes) else str(body))]
    if not isinstance(obj, dict):
        return [ReportSection("Body", _kind(obj), _section_data(obj))]
    summary = {k: v for k, v in obj.items() if _scalarish(v)}
    out = [ReportSection("Summary", "fields", _fields(summary))] if summary else []
    for key, value in obj.items():
        if key not in summary:
            out.extend(_sections(str(key), value))
    return out


def _scalarish(v: Any) -> bool:
    return not isinstance(v, dict | list) or (isinstance(v, list) and all(not isinstance(x, dict | list) for x in v))


def _is_records(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _kind(v: Any) -> str:
    return "table" if _is_records(v) else "fields" if isinstance(v, dict) else "json"


def _cell(v: Any) -> Any:
    if isinstance(v, dict | list):
        return json.dumps(v, separators=(",", ":"))
    return v


def _section_data(v: Any) -> Any:
    if _is_records(v):
        return pd.DataFrame([{str(k): _cell(x) for k, x in r.items()} for r in v])
    if isinstance(v, dict):
        return _fields(v)
    return v


def _fields(d: dict[str, Any]) -> pd.DataFrame:
    return pd.DataFrame({"name": [str(k) for k in d],
                         "value": [", ".join(map(str, v)) if isinstance(v, list) else
                                   json.dumps(v) if isinstance(v, dict) else "" if v is None else str(v)
                                   for v in d.values()]})


def _sections(title: str, value: Any) -> list[ReportSection]:
    if isinstance(value, dict) and any(_is_records(v) or isinstance(v, dict) for v in value.values()):
        flat = {k: v for k, v in value.items() if _scalarish(v)}
        out = [ReportSection(title, "fields", _fields(flat))] if flat else []
        for k, v in value.items():
            if k not in flat:
                out.extend(_sections(f"{title} / {k}", v))
        return out
    if isinstance(value, list) and not value:
        return [ReportSection(title, "json", [])]
    return [ReportSection(title, _kind(value), _section_data(value))]
