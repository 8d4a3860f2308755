"""``rankscope sql "SELECT ..." [--format table|csv|json]``: one read-only statement against the store.

The statement passes the SQL console's guard (``rankscope/sql_guard.py``: one SELECT, WITH, SHOW,
DESCRIBE or EXPLAIN; no file, URL or remote table functions) and runs with ``readonly=1``. With an
embedded store held by ``rankscope serve``/``up`` it runs in that process, through serve's loopback
query endpoint; otherwise the command opens the store itself (a ClickHouse server DSN goes straight
to the server). Exit status: 0 answered; 1 store unavailable or ClickHouse refused the statement;
2 refused by the guard or bad arguments.
"""

from __future__ import annotations

import argparse
import sys

from rankscope.config import Settings
from rankscope.sql_guard import DEFAULT_MAX_ROWS, DEFAULT_TIMEOUT_S, SqlRefused, check_readonly_sql

FORMATS = ("table", "csv", "json")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("sql", parents=[common], help="run one read-only SQL statement against the store",
                       description="Run one read-only statement (SELECT, WITH, SHOW, DESCRIBE, EXPLAIN) against "
                                   "the store and print the rows. Works while `rankscope serve` holds the "
                                   "embedded store. Tables live in database `rankscope` (unqualified names work).")
    p.add_argument("statement", help='the statement, e.g. "SELECT job, count() FROM steps GROUP BY job"')
    p.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    p.add_argument("--max-rows", type=int, default=DEFAULT_MAX_ROWS,
                   help=f"at most this many rows (default {DEFAULT_MAX_ROWS})")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"ClickHouse's time limit in seconds (default {DEFAULT_TIMEOUT_S:g})")
    p.set_defaults(func=run)


def _err(msg: str, rc: int) -> int:
    print(f"rankscope sql: error: {msg}", file=sys.stderr)
    return rc


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.max_rows <= 0 or args.timeout <= 0:
        return _err("--max-rows and --timeout must be > 0", 2)
    try:
        check_readonly_sql(args.statement)
    except SqlRefused as e:
        return _err(f"refused: {e}", 2)

    from rankscope.storage import query_endpoint
    from rankscope.storage.readonly import run_readonly
    from rankscope.storage.store import StoreError, StoreLocked, close_store, open_store

    dsn = settings.store_dsn
    try:
        ep = query_endpoint.endpoint_for(settings.data_dir, dsn) if dsn.startswith("chdb://") else None
        if ep is not None:
            res = query_endpoint.query(ep, args.statement, max_rows=args.max_rows, timeout_s=args.timeout)
        else:
            store = open_store(dsn)
            try:
                res = run_readonly(store, args.statement, args.max_rows, args.timeout)
            finally:
                close_store(dsn)
    except SqlRefused as e:
        return _err(f"refused: {e}", 2)
    except StoreLocked as e:
        return _err(f"{e}\nhint: start `rankscope serve` anew (it answers other processes' queries), "
                    "or stop the process that holds the store", 1)
    except StoreError as e:
        return _err(str(e), 1)
    write(res.frame, args.format, sys.stdout)
    n = len(res.frame)
    note = f"{n} row{'s' if n != 1 else ''} in {res.elapsed_s:.3f} s"
    if res.truncated:
        note += f" (only the first {args.max_rows}; raise --max-rows, add a LIMIT or aggregate)"
    print(note, file=sys.stderr)
    return 0


def write(frame, fmt: str, out) -> None:
    """Print ``frame`` as an aligned table, CSV (with header) or JSON (one array of row objects)."""
    if fmt == "csv":
        frame.to_csv(out, index=False)
    elif fmt == "json":
        out.write(frame.to_json(orient="records", date_format="iso", default_handler=str) + "\n")
    elif frame.empty:
        out.write(" ".join(str(c) for c in frame.columns) + "\n")
    else:
        out.write(frame.to_string(index=False) + "\n")
