"""The ranks' sampled stacks in the store (table ``profile_samples``): query functions over a
:class:`~rankscope.storage.store.Store`, read by ``rankscope export --profile`` (:func:`profile_rows`)
and the dashboard's profile panel (:func:`path_seconds` for all ranks, :func:`rank_path_seconds` for
one rank against its peers: both summed in the store). They block until ClickHouse answers and raise
:class:`~rankscope.storage.store.StoreError`.
"""

from __future__ import annotations

import pandas as pd

from rankscope.profiles import OTHER
from rankscope.storage.store import Store

ROW_COLUMNS = ["rank", "role", "path", "samples", "hz"]
MAX_ROWS = 200_000
MAX_INTERVAL_NS = 3600 * 10**9   # a profile interval longer than this (profile_s) is not found by its end


def profile_rows(store: Store, job: str, ranks: list[int] | None = None, t0_ns: int = 0, t1_ns: int = 0,
                 roles: list[str] | None = None, hosts: list[str] | None = None) -> pd.DataFrame:
    """Samples per (rank, role, call path) of ``job`` in the intervals that overlap [t0_ns, t1_ns)
    (0: open), summed over intervals: :data:`ROW_COLUMNS`."""
    where, params = _where(job, ranks, t0_ns, t1_ns, roles, hosts)
    sql = f"""
        SELECT rank, role, path, sum(samples), any(hz)
        FROM {store.database}.profile_samples FINAL WHERE {where}
        GROUP BY rank, role, path ORDER BY rank, role, path LIMIT {MAX_ROWS}"""
    rows = store.query_rows(sql, parameters=params)
    return pd.DataFrame([list(r) for r in rows], columns=ROW_COLUMNS)


def _where(job: str, ranks: list[int] | None, t0_ns: int, t1_ns: int, roles: list[str] | None,
           hosts: list[str] | None) -> tuple[str, dict[str, object]]:
    where = ["job = {job:String}"]
    params: dict[str, object] = {"job": job}
    # (condition, parameter name, value): a filter applies when its value is given.
    filters = (("rank IN {ranks:Array(Int32)}", "ranks", None if ranks is None else list(ranks)),
               ("role IN {roles:Array(String)}", "roles", list(roles) if roles else None),
               ("host IN {hosts:Array(String)}", "hosts", list(hosts) if hosts else None),
               # An interval that overlaps [t0, t1); the bound on its start prunes the day partitions.
               (f"ts_ns > {{t0:Int64}} - {MAX_INTERVAL_NS} AND ts_ns + interval_ns > {{t0:Int64}}", "t0",
                int(t0_ns) or None),
               ("ts_ns < {t1:Int64}", "t1", int(t1_ns) or None))
    for condition, name, value in filters:
        if value is not None:
            where.append(condition)
            params[name] = value
    return " AND ".join(where), params


def path_seconds(store: Store, job: str, t0_ns: int = 0, t1_ns: int = 0, roles: list[str] | None = None,
                 hosts: list[str] | None = None) -> pd.DataFrame:
    """Self seconds per call path over every rank (and role) of ``job`` in the intervals that overlap
    [t0_ns, t1_ns): path, seconds; the samples that left the messages as ``(other)``. Summed in the
    store, so a job of 10,000 ranks returns its few dozen paths, not its ranks' rows."""
    where, params = _where(job, None, t0_ns, t1_ns, roles, hosts)
    rows = store.query_rows(f"""
        SELECT path_hash, sum(samples / hz) AS seconds, min(rank) AS first_rank
        FROM {store.database}.profile_samples FINAL WHERE {where}
        GROUP BY path_hash ORDER BY path_hash LIMIT {MAX_ROWS}""", parameters=params)
    text = _path_texts(store, job, {int(h): int(r) for h, _, r in rows})
    df = pd.DataFrame({"path": [text.get(int(h), OTHER) for h, _, _ in rows], "seconds": [float(s) for _, s, _ in rows]})
    return df.sort_values("path", ignore_index=True)


def _path_texts(store: Store, job: str, first_rank: dict[int, int]) -> dict[int, str]:
    """The text of each call-path hash, read from the rows of one rank that has it (``first_rank``:
    hash -> rank): the primary key leads to those ranks' rows, so few paths are read whatever the
    job's size. "" (the samples that left the messages) comes back as ``(other)``."""
    if not first_rank:
        return {}
    rows = store.query_rows(f"""
        SELECT path_hash, any(path) FROM {store.database}.profile_samples
        WHERE job = {{job:String}} AND rank IN {{ranks:Array(Int32)}} AND path_hash IN {{hs:Array(UInt64)}}
        GROUP BY path_hash""", {"job": job, "ranks": sorted(set(first_rank.values())), "hs": sorted(first_rank)})
    return {int(h): str(p) or OTHER for h, p in rows}


def rank_path_seconds(store: Store, job: str, t0_ns: int = 0, t1_ns: int = 0, roles: list[str] | None = None,
                      hosts: list[str] | None = None, ranks: list[int] | None = None) -> pd.DataFrame:
    """Self seconds per (rank, call path) of ``job`` (roles summed) in the intervals that overlap
    [t0_ns, t1_ns): rank, path, seconds, by rank; the samples that left the messages as ``(other)``.
    ``path`` is a categorical: the store sends each row's path as its hash and each distinct path's
    text once, so 10,000 ranks' rows do not carry their call paths' text."""
    where, params = _where(job, ranks, t0_ns, t1_ns, roles, hosts)
    df = store.query_df(f"""
        SELECT rank, path_hash AS h, sum(samples / hz) AS seconds
        FROM {store.database}.profile_samples FINAL WHERE {where}
        GROUP BY rank, h ORDER BY rank, h""", params)
    if df.empty:
        return pd.DataFrame({"rank": pd.Series(dtype="int64"), "path": pd.Categorical([]),
                             "seconds": pd.Series(dtype="float64")})
    first = df.groupby("h", sort=False)["rank"].min()
    hashes = [int(h) for h in first.index]
    text = _path_texts(store, job, dict(zip(hashes, (int(r) for r in first), strict=True)))
    by_hash = pd.Index(hashes, dtype="uint64").get_indexer(df["h"].astype("uint64"))
    text_codes, texts = pd.factorize(pd.Index([text.get(h, OTHER) for h in hashes], dtype=object))
    path = pd.Categorical.from_codes(text_codes[by_hash], categories=texts)
    return pd.DataFrame({"rank": df["rank"].astype("int64"), "path": path, "seconds": df["seconds"].astype(float)})
