"""The store client: one clickhouse-connect client built from one DSN, shared by the threads of a process.

``chdb:///path`` opens the embedded engine (chDB) on disk; only one process may open a directory,
so :func:`open_store` raises :class:`StoreLocked` with a clear message when another process holds it.
``http://host:8123`` talks to a ClickHouse server (``https://`` over TLS; ``user:password@host``,
``?ca_cert=/path.pem`` and ``?verify=false`` as :attr:`rankscope.config.Settings.store_dsn` folds them in).
The same schema and queries serve both. A password never appears in a message or a repr.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlparse

import pandas as pd

from rankscope.config import redact_dsn
from rankscope.retention import TABLE_TTL_DAYS

log = logging.getLogger(__name__)

DATABASE = "rankscope"


class StoreError(RuntimeError):
    """The store could not be opened or a statement failed."""


class StoreLocked(StoreError):
    """Another process holds the embedded (chDB) data directory."""


class Store:
    """Thread-safe facade over a clickhouse-connect client.

    Calls block until the statement finishes; errors surface as :class:`StoreError`.
    """

    def __init__(self, client: Any, dsn: str, database: str = DATABASE) -> None:
        self._client = client
        self._lock = threading.RLock()
        self.dsn = dsn   # may hold a password: show redact_dsn(dsn)
        self.database = database

    def __repr__(self) -> str:
        return f"Store({redact_dsn(self.dsn)!r}, database={self.database!r})"

    @property
    def embedded(self) -> bool:
        return self.dsn.startswith("chdb://")

    def command(self, sql: str, parameters: dict[str, Any] | None = None,
                settings: dict[str, Any] | None = None) -> Any:
        with self._lock:
            try:
                return self._client.command(sql, parameters=parameters, settings=settings)
            except Exception as e:
                raise StoreError(f"{type(e).__name__}: {e}") from e

    def query_df(self, sql: str, parameters: dict[str, Any] | None = None,
                 settings: dict[str, Any] | None = None) -> pd.DataFrame:
        """Run a SELECT and return a DataFrame (empty DataFrame with columns when no rows)."""
        with self._lock:
            try:
                res = self._client.query(sql, parameters=parameters, settings=settings)
                if not res.result_rows and not res.column_names:
                    # chDB returns no column names for an empty result; Arrow keeps the schema.
                    return self._client.query_arrow(sql, parameters=parameters, settings=settings).to_pandas()
            except Exception as e:
                raise StoreError(f"{type(e).__name__}: {e}") from e
        return pd.DataFrame(res.result_rows, columns=list(res.column_names))

    def query_rows(self, sql: str, parameters: dict[str, Any] | None = None,
                   settings: dict[str, Any] | None = None) -> list[tuple]:
        with self._lock:
            try:
                return list(self._client.query(sql, parameters=parameters, settings=settings).result_rows)
            except Exception as e:
                raise StoreError(f"{type(e).__name__}: {e}") from e

    def insert(self, table: str, rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> int:
        """Insert row dicts into ``database.table``. Returns the number of rows written."""
        if not rows:
            return 0
        cols = list(columns or rows[0].keys())
        data = [[r.get(c) for c in cols] for r in rows]
        with self._lock:
            try:
                self._client.insert(table, data, column_names=cols, database=self.database)
            except Exception as e:
                raise StoreError(f"insert into {table}: {type(e).__name__}: {e}") from e
        return len(rows)

    def insert_columns(self, table: str, columns: dict[str, list[Any]],
                       arrow_types: dict[str, str] | None = None) -> int:
        """Column-oriented insert (fast path for large batches); as Arrow when ``arrow_types`` gives
        each column's Arrow type (see ``ARROW_TYPES`` in storage/columns.py)."""
        names = list(columns)
        if not names or not columns[names[0]]:
            return 0
        with self._lock:
            try:
                if arrow_types is None:
                    self._client.insert(table, [columns[n] for n in names], column_names=names,
                                        database=self.database, column_oriented=True)
                else:
                    self._client.insert_arrow(table, arrow_table(columns, arrow_types), database=self.database)
            except Exception as e:
                raise StoreError(f"insert into {table}: {type(e).__name__}: {e}") from e
        return len(columns[names[0]])

    def insert_arrow(self, table: str, data: Any) -> int:
        """Insert a pyarrow Table as it is (its columns named as the table's; dictionary arrays for
        repeated strings, built without touching each value). Returns the number of rows written."""
        if data.num_rows == 0:
            return 0
        with self._lock:
            try:
                self._client.insert_arrow(table, data, database=self.database)
            except Exception as e:
                raise StoreError(f"insert into {table}: {type(e).__name__}: {e}") from e
        return int(data.num_rows)

    def close(self) -> None:
        with self._lock:
            try:
                self._client.close()
            except Exception:  # closing twice or a dead server is fine
                pass


def schema_statements(database: str = DATABASE, ttl_days: Mapping[str, int] | None = None) -> list[str]:
    """schema.sql's statements for ``database``, each expiring table's TTL from ``ttl_days`` (default:
    rankscope/retention.py's)."""
    text = resources.files("rankscope.storage").joinpath("schema.sql").read_text()
    days = {**TABLE_TTL_DAYS, **(ttl_days or {})}
    return [_TTL_SLOT.sub(lambda m: str(int(days[m.group(1)])), stmt) for stmt in _split(text, database)]


def migration_statements(database: str = DATABASE) -> list[tuple[int, str, list[str]]]:
    """Numbered migrations in storage/migrations/NNNN_name.sql, oldest first."""
    out = []
    mig_dir = resources.files("rankscope.storage").joinpath("migrations")
    for entry in sorted(mig_dir.iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".sql") and entry.name[:4].isdigit():
            out.append((int(entry.name[:4]), entry.name[5:-4], _split(entry.read_text(), database)))
    return out


def _split(text: str, database: str) -> list[str]:
    stmts = []
    for chunk in text.split("\n;"):
        body = "\n".join(line for line in chunk.splitlines() if not line.strip().startswith("--")).strip()
        if body.strip(";").strip():
            stmts.append(body.strip().rstrip(";").replace("{db}", database))
    return stmts


_TTL_SLOT = re.compile(r"\{ttl:(\w+)\}")
_CREATE = re.compile(r"^CREATE TABLE IF NOT EXISTS (\S+)\.(\w+)\b")
_TTL_DAYS = re.compile(r"\bTTL .*?(?:INTERVAL (\d+) DAY|toIntervalDay\((\d+)\))")


def apply_schema(store: Store, ttl_days: Mapping[str, int] | None = None) -> None:
    """Create the database and tables if missing, rebuild an expiring table made before it was
    partitioned by day (:func:`partition_by_day`), apply new numbered migrations, and, with
    ``ttl_days`` (the writer's settings), set each expiring table's TTL to it. Idempotent."""
    stmts = schema_statements(store.database, ttl_days)
    for stmt in stmts:
        store.command(stmt)
    creates = {m.group(2): stmt for stmt in stmts if (m := _CREATE.match(stmt))}
    for table in TABLE_TTL_DAYS:
        partition_by_day(store, table, creates[table])
    done = {int(r[0]) for r in store.query_rows(f"SELECT version FROM {store.database}.schema_migrations")}
    for version, name, mig in migration_statements(store.database):
        if version in done:
            continue
        for stmt in mig:
            store.command(stmt)
        store.insert("schema_migrations", [{"version": version, "name": name}])
        log.info("applied migration %04d_%s", version, name)
    if ttl_days is not None:
        for table, days in {**TABLE_TTL_DAYS, **ttl_days}.items():
            set_ttl_days(store, table, creates[table], int(days))


def _table_info(store: Store, table: str) -> tuple[str, str] | None:
    rows = store.query_rows("SELECT partition_key, create_table_query FROM system.tables "
                            "WHERE database = {d:String} AND name = {t:String}", {"d": store.database, "t": table})
    return (str(rows[0][0]), str(rows[0][1])) if rows else None


def partition_by_day(store: Store, table: str, create: str) -> bool:
    """Rebuild ``table`` as ``create`` (schema.sql's, partitioned by day) when it was made before
    that: its rows are copied into a new table, which then takes its place. Safe to run again after
    a crash at any point. Returns True when it rebuilt the table."""
    db = store.database
    info = _table_info(store, table)
    if info is None:
        return False
    staged = f"{table}__by_day"
    if info[0]:
        store.command(f"DROP TABLE IF EXISTS {db}.{staged}")   # a rebuild that stopped after the exchange
        return False
    log.info("partitioning %s.%s by day: copying its rows into a new table", db, table)
    store.command(f"DROP TABLE IF EXISTS {db}.{staged}")
    store.command(_CREATE.sub(f"CREATE TABLE {db}.{staged}", create, count=1))
    cols = ", ".join(f"`{c}`" for c in _stored_columns(store, table) if c in set(_stored_columns(store, staged)))
    store.command(f"INSERT INTO {db}.{staged} ({cols}) SELECT {cols} FROM {db}.{table}")
    store.command(f"EXCHANGE TABLES {db}.{table} AND {db}.{staged}")
    store.command(f"DROP TABLE IF EXISTS {db}.{staged}")
    return True


def _stored_columns(store: Store, table: str) -> list[str]:
    """The columns of ``table`` that hold data (not MATERIALIZED or ALIAS), in order."""
    return [str(r[0]) for r in store.query_rows(
        "SELECT name FROM system.columns WHERE database = {d:String} AND table = {t:String} "
        "AND default_kind NOT IN ('MATERIALIZED', 'ALIAS') ORDER BY position", {"d": store.database, "t": table})]


def set_ttl_days(store: Store, table: str, create: str, days: int) -> bool:
    """``ALTER TABLE ... MODIFY TTL`` when ``table``'s TTL is not ``days`` days. Returns True when changed."""
    info = _table_info(store, table)
    m = _TTL_DAYS.search(info[1]) if info else None
    if info is None or m is None or int(m.group(1) or m.group(2)) == days:
        return False
    ttl = _TTL_DAYS.search(create)
    assert ttl is not None, f"schema.sql's {table} has no TTL"
    expr = create[ttl.start():ttl.end()].split("\n")[0]
    store.command(f"ALTER TABLE {store.database}.{table} MODIFY {expr}")
    log.info("%s.%s keeps its rows %d days now", store.database, table, days)
    return True


_STORES: dict[str, Store] = {}
_STORES_LOCK = threading.Lock()


def arrow_table(columns: dict[str, list[Any]], types: dict[str, str]) -> Any:
    """A pyarrow Table of ``columns`` with the named Arrow types ("dict" = dictionary-encoded string)."""
    import pyarrow as pa

    named = {"dict": pa.dictionary(pa.int32(), pa.string()), "int32": pa.int32(), "uint32": pa.uint32(),
             "int64": pa.int64(), "float32": pa.float32(), "float64": pa.float64()}
    return pa.table({n: pa.array(col, type=named[types[n]]) for n, col in columns.items()})


def open_store(dsn: str, apply: bool = True, ttl_days: Mapping[str, int] | None = None) -> Store:
    """Open (once per process and DSN) and return the shared store; apply the schema the first time
    (with ``ttl_days``, the writer's TTLs: :func:`apply_schema`).

    Raises StoreLocked when another process holds an embedded data directory, StoreError otherwise.
    """
    with _STORES_LOCK:
        if dsn in _STORES:
            return _STORES[dsn]
        client = _connect(dsn)
        store = Store(client, dsn)
        if apply:
            apply_schema(store, ttl_days)
        _STORES[dsn] = store
        return store


def close_store(dsn: str) -> None:
    with _STORES_LOCK:
        store = _STORES.pop(dsn, None)
    if store is not None:
        store.close()


def _connect(dsn: str) -> Any:
    import clickhouse_connect

    if dsn.startswith("chdb://"):
        path = dsn[len("chdb://"):]
        Path(path).mkdir(parents=True, exist_ok=True)
        try:
            return clickhouse_connect.get_client(dsn=dsn)
        except Exception as e:
            msg = str(e)
            if "already initialized with path" in msg:
                # chDB also allows one directory per *process*: this process has another one open.
                raise StoreError(
                    f"cannot open {path}: this process already has another embedded store open "
                    f"(chDB allows one data directory per process; close_store() it first). "
                    f"({type(e).__name__}: {e})") from e
            if "lock" in msg.lower() or "EmbeddedServer" in msg or "already running" in msg:
                raise StoreLocked(
                    f"the embedded store {path} is open in another process (chDB allows one). "
                    "Stop `rankscope serve`/`rankscope up` first, or point RANKSCOPE_CLICKHOUSE_DSN "
                    f"at a ClickHouse server. ({type(e).__name__}: {e})") from e
            raise StoreError(f"cannot open {dsn}: {type(e).__name__}: {e}") from e
    params = server_params(dsn)
    try:
        return clickhouse_connect.get_client(**params)
    except Exception as e:
        where = f"{'https' if params['secure'] else 'http'}://{params['host']}:{params['port']}"
        detail = str(e).replace(params["password"], "***") if params["password"] else str(e)
        raise StoreError(f"cannot reach ClickHouse at {where} as user {params['username'] or 'default'}: "
                         f"{type(e).__name__}: {detail}") from None


_DSN_OPTIONS = {"ca_cert", "verify"}


def server_params(dsn: str) -> dict[str, Any]:
    """``clickhouse_connect.get_client`` keyword arguments for a server DSN:
    ``http[s]://[user[:password]@]host[:port][?ca_cert=/ca.pem&verify=false]``.

    https means TLS (``secure``), verified against ``ca_cert`` (else the system CAs) unless
    ``verify=false``; the port defaults to 8123 (http) or 8443 (https). Raises StoreError, whose
    message never holds the password, for another scheme, a missing host or an unknown option.
    """
    u = urlparse(dsn)
    shown = redact_dsn(dsn)
    if u.scheme not in ("http", "https"):
        raise StoreError(f"unsupported DSN scheme in {shown!r}; use chdb:///path or http://host:8123")
    try:
        host, port = u.hostname, u.port
    except ValueError as e:
        raise StoreError(f"bad host or port in the DSN {shown!r}: {e}") from None
    if not host:
        raise StoreError(f"no host in the DSN {shown!r}")
    query = dict(parse_qsl(u.query))
    unknown = sorted(set(query) - _DSN_OPTIONS)
    if unknown:
        raise StoreError(f"unknown option(s) {unknown} in the DSN {shown!r}; known: {sorted(_DSN_OPTIONS)}")
    secure = u.scheme == "https"
    params: dict[str, Any] = {"host": host, "port": port or (8443 if secure else 8123),
                              "username": unquote(u.username) if u.username else None,
                              "password": unquote(u.password) if u.password else "", "secure": secure}
    if secure:
        params["verify"] = query.get("verify", "true").lower() not in ("false", "0", "no", "off")
        if "ca_cert" in query:
            params["ca_cert"] = query["ca_cert"]
    elif "ca_cert" in query or "verify" in query:
        raise StoreError(f"ca_cert and verify need an https DSN, got {shown!r}")
    return params
