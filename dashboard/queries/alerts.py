"""Alerts, their stack groups and the rank-seconds they cost."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from rankscope.dashboard.queries.common import as_datetime, check_positive, now_or_wall_ns
from rankscope.sql_guard import READONLY_STATEMENTS as READONLY_STATEMENTS
from rankscope.sql_guard import SqlRefused as SqlRefused
from rankscope.sql_guard import check_readonly_sql as check_readonly_sql
from rankscope.sql_guard import readonly_settings as readonly_settings
from rankscope.storage.readonly import SqlResult as SqlResult
from rankscope.storage.readonly import run_readonly as run_readonly
from rankscope.storage.store import Store
from rankscope.storage.store import StoreError as StoreError

# Alerts -----------------------------------------------------------------------------------------

ALERTS_COLUMNS = ["alert_id", "job", "kind", "status", "open", "severity", "ranks", "step", "opened",
                  "updated", "resolved", "duration_s", "version", "summary", "lost_rank_seconds", "body"]


def alerts(store: Store, job: str | None = None, include_resolved: bool = True, limit: int = 500,
           now_ns: int | None = None) -> pd.DataFrame:
    """The latest version of each alert (of one job, or all jobs when ``job`` is None).

    Open alerts first, then newest first. ``open`` is ``status != 'resolved'``; ``duration_s`` runs
    from opening to resolution (or to ``now_ns`` while open). ``body`` is the alert's JSON.
    """
    check_positive("limit", limit)
    db = store.database
    sql = f"""
        SELECT alert_id, job, kind, status, severity, ranks, step, opened_ns, updated_ns, resolved_ns,
               version, summary, lost_rank_seconds, body
        FROM (SELECT * FROM {db}.alerts
              WHERE ({{job:String}} = '' OR job = {{job:String}})
              ORDER BY version DESC LIMIT 1 BY job, alert_id)
        WHERE {{all:UInt8}} OR status != 'resolved'
        ORDER BY status = 'resolved', updated_ns DESC
        LIMIT {{limit:UInt32}}
    """
    df = store.query_df(sql, {"job": job or "", "all": int(include_resolved), "limit": int(limit)})
    if df.empty:
        return pd.DataFrame(columns=ALERTS_COLUMNS)
    now = now_or_wall_ns(now_ns)
    df["open"] = df["status"] != "resolved"
    end = df["resolved_ns"].where(~df["open"] & (df["resolved_ns"] > 0), now)
    df["duration_s"] = ((end - df["opened_ns"]) / 1e9).clip(lower=0).round(1)
    df["opened"] = as_datetime(df["opened_ns"])
    df["updated"] = as_datetime(df["updated_ns"])
    df["resolved"] = as_datetime(df["resolved_ns"])
    df["ranks"] = df["ranks"].map(lambda r: [int(x) for x in r])
    return df[ALERTS_COLUMNS].reset_index(drop=True)


STACK_COLUMNS = ["alert_id", "group", "ranks", "thread", "frames", "waiting_in_collective", "culprit"]


def parse_stack_groups(alerts_df: pd.DataFrame) -> pd.DataFrame:
    """Explode the ``stack_groups`` of each alert's JSON body into rows. Pure; no I/O.

    ``frames`` is a list of "file:line func", outermost first. ``culprit`` is True when the group
    holds one of the alert's culprit ranks. Bodies that are not JSON or lack groups add no rows.
    """
    out: list[dict[str, Any]] = []
    for alert_id, culprits, body in zip(alerts_df.get("alert_id", []), alerts_df.get("ranks", []),
                                        alerts_df.get("body", []), strict=True):
        try:
            groups = json.loads(body or "{}").get("stack_groups") or []
        except (ValueError, AttributeError):
            continue
        for i, g in enumerate(groups):
            if not isinstance(g, dict):
                continue
            gr = [int(r) for r in g.get("ranks") or []]
            out.append({"alert_id": alert_id, "group": i, "ranks": gr, "thread": str(g.get("thread", "")),
                        "frames": [str(f) for f in g.get("frames") or []],
                        "waiting_in_collective": bool(g.get("waiting_in_collective", False)),
                        "culprit": bool(set(gr) & {int(c) for c in culprits})})
    return pd.DataFrame(out, columns=STACK_COLUMNS)


def alert_stack_groups(store: Store, job: str | None = None, include_resolved: bool = True) -> pd.DataFrame:
    """Stack groups of the alerts of a job (or all jobs): :data:`STACK_COLUMNS`."""
    return parse_stack_groups(alerts(store, job=job, include_resolved=include_resolved))


LOST_COLUMNS = ["alert_id", "job", "kind", "status", "ranks", "step", "duration_s", "lost_rank_seconds",
                "estimated"]


def lost_time(alerts_df: pd.DataFrame, world_sizes: dict[str, int]) -> pd.DataFrame:
    """Lost rank-seconds per alert. Pure; no I/O.

    The processors' own estimate wins when present. Otherwise a hang or dead rank stalls the whole
    job, so the estimate is world size x incident duration (``estimated`` is then True).
    """
    if alerts_df.empty:
        return pd.DataFrame(columns=LOST_COLUMNS)
    df = alerts_df.copy()
    reported = df["lost_rank_seconds"].astype(float)
    stall = df["kind"].isin(["hang", "dead_rank"]) & (reported <= 0)
    ws = df["job"].map(lambda j: max(1, int(world_sizes.get(j, 1) or 1)))
    df["lost_rank_seconds"] = reported.where(~stall, ws * df["duration_s"]).round(1)
    df["estimated"] = stall
    return df[LOST_COLUMNS].sort_values("lost_rank_seconds", ascending=False).reset_index(drop=True)


# The collectives of an incident -----------------------------------------------------------------

COLLECTIVE_COLUMNS = ["alert_id", "rank", "process_group", "last_enqueued", "last_started", "last_completed"]


def incident_collectives(store: Store, incidents: tuple[tuple[str, str], ...]) -> pd.DataFrame:
    """For each ``(job, alert_id)`` of a hang or mismatch: each rank's last enqueued / started /
    completed collective per process group, from the Flight Recorder dumps its incident asked for
    (request ``flight-<alert_id>``): :data:`COLLECTIVE_COLUMNS`."""
    from rankscope.storage.fr_dumps import collective_states, rank_dumps

    frames = []
    for job, alert_id in incidents:
        states = collective_states(rank_dumps(store, job, f"flight-{alert_id}"))
        if not states.empty:
            frames.append(states.assign(alert_id=alert_id))
    if not frames:
        return pd.DataFrame(columns=COLLECTIVE_COLUMNS)
    return pd.concat(frames, ignore_index=True)[COLLECTIVE_COLUMNS]
