"""The ranks' sampled stacks in the store (table ``profile_samples``): one query function over a
:class:`~rankscope.storage.store.Store`, read by ``rankscope export --profile`` and the dashboard.
It blocks until ClickHouse answers and raises :class:`~rankscope.storage.store.StoreError`.
"""

from __future__ import annotations

import pandas as pd

from rankscope.storage.store import Store

ROW_COLUMNS = ["rank", "role", "path", "samples", "hz"]
MAX_ROWS = 200_000


def profile_rows(store: Store, job: str, ranks: list[int] | None = None, t0_ns: int = 0, t1_ns: int = 0,
                 roles: list[str] | None = None, hosts: list[str] | None = None) -> pd.DataFrame:
    """Samples per (rank, role, call path) of ``job`` in the intervals that start in [t0_ns, t1_ns)
    (0: open), summed over intervals: :data:`ROW_COLUMNS`."""
    where = ["job = {job:String}"]
    params: dict[str, object] = {"job": job}
    # (condition, parameter name, value): a filter applies when its value is given.
    filters = (("rank IN {ranks:Array(Int32)}", "ranks", None if ranks is None else list(ranks)),
               ("role IN {roles:Array(String)}", "roles", list(roles) if roles else None),
               ("host IN {hosts:Array(String)}", "hosts", list(hosts) if hosts else None),
               ("ts_ns >= {t0:Int64}", "t0", int(t0_ns) or None),
               ("ts_ns < {t1:Int64}", "t1", int(t1_ns) or None))
    for condition, name, value in filters:
        if value is not None:
            where.append(condition)
            params[name] = value
    sql = f"""
        SELECT rank, role, path, sum(samples), any(hz)
        FROM {store.database}.profile_samples FINAL WHERE {' AND '.join(where)}
        GROUP BY rank, role, path ORDER BY rank, role, path LIMIT {MAX_ROWS}"""
    rows = store.query_rows(sql, parameters=params)
    return pd.DataFrame([list(r) for r in rows], columns=ROW_COLUMNS)
