"""The ranks' PyTorch Flight Recorder dumps in the store (table ``fr_dumps``): which requests a job
has dumps for, each rank's dump of one request, and the collective table of a request (rank x
process group x last enqueued / started / completed). Pure query functions over a
:class:`~rankscope.storage.store.Store`, read by ``rankscope export --fr-dump`` and the Alerts page.
They block until ClickHouse answers and raise :class:`~rankscope.storage.store.StoreError`.
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from rankscope.storage.store import Store

REQUEST_COLUMNS = ["request_id", "reason", "ranks", "first_ns", "last_ns"]
STATE_COLUMNS = ["rank", "process_group", "last_enqueued", "last_started", "last_completed"]


def dump_requests(store: Store, job: str, limit: int = 50) -> pd.DataFrame:
    """The requests with stored dumps of ``job``, newest first: :data:`REQUEST_COLUMNS`."""
    sql = f"""
        SELECT request_id, any(reason), uniqExact(rank), min(ts_ns), max(ts_ns)
        FROM {store.database}.fr_dumps WHERE job = {{job:String}}
        GROUP BY request_id ORDER BY max(ts_ns) DESC LIMIT {int(limit)}"""
    rows = store.query_rows(sql, parameters={"job": job})
    return pd.DataFrame([list(r) for r in rows], columns=REQUEST_COLUMNS)


def resolve_request(store: Store, job: str, request: str) -> str | None:
    """``request`` when the job has dumps for it, else the newest request id starting with it
    (the newest of all when ``request`` is empty); None when there is none."""
    ids = [str(r) for r in dump_requests(store, job, limit=10_000)["request_id"]]
    if request in ids:
        return request
    return next((r for r in ids if r.startswith(request)), None)


def rank_dumps(store: Store, job: str, request_id: str) -> dict[int, dict[str, Any]]:
    """Each rank's newest dump for ``request_id``, parsed: rank -> the recorder's dump."""
    sql = f"""
        SELECT rank, argMax(dump, ts_ns) FROM {store.database}.fr_dumps
        WHERE job = {{job:String}} AND request_id = {{request_id:String}} GROUP BY rank ORDER BY rank"""
    rows = store.query_rows(sql, parameters={"job": job, "request_id": request_id})
    return {int(rank): json.loads(dump) for rank, dump in rows}


def collective_states(dumps: dict[int, dict[str, Any]]) -> pd.DataFrame:
    """The collective table of a request's dumps: one row per rank and process group with the group's
    last enqueued, started and completed collective (-1 unknown): :data:`STATE_COLUMNS`."""
    rows = []
    for rank, dump in sorted(dumps.items()):
        for pg, st in sorted((dump.get("pg_status") or {}).items()):
            if isinstance(st, dict):
                rows.append([rank, str(pg)] + [_int(st.get(f"last_{k}_collective")) for k in
                                               ("enqueued", "started", "completed")])
    return pd.DataFrame(rows, columns=STATE_COLUMNS)


def with_group_configs(dumps: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The dumps with every process group their entries name in ``pg_config``, as PyTorch's
    analyzer needs to match the ranks' collectives. gloo's recorder (torch 2.15) lists the default
    group under the name ``''`` only; a missing group gets the ranks whose dumps recorded it."""
    members: dict[str, set[int]] = {}
    descs: dict[str, str] = {}
    for rank, dump in dumps.items():
        for e in dump.get("entries") or []:
            pg = e.get("process_group") or ["", ""]
            members.setdefault(str(pg[0]), set()).add(rank)
            descs.setdefault(str(pg[0]), str(pg[1]) if len(pg) > 1 else "")
    out = {}
    for rank, dump in dumps.items():
        config = dict(dump.get("pg_config") or {})
        for pg, ranks in members.items():
            if pg not in config:
                config[pg] = {"name": pg, "desc": descs[pg], "ranks": str(sorted(ranks))}
        out[rank] = {**dump, "pg_config": config}
    return out


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1
