"""``rankscope readonly-user --user NAME [--apply]``: the ClickHouse user for the dashboard and the SQL
console against a server (storage/readonly_user.py: SELECT on rankscope's database, a read-only
settings profile). The password comes from ``RANKSCOPE_READONLY_PASSWORD`` (never a flag, so it stays
out of process lists) and is sent only as its SHA-256. Prints the statements; ``--apply`` runs them
with the configured server DSN, whose user must be allowed to create users. Exit status: 0 done;
1 ClickHouse refused; 2 bad arguments, no password, or an embedded (chDB) store, which has no users.
"""

from __future__ import annotations

import argparse
import os
import sys

from rankscope.config import Settings

PASSWORD_ENV = "RANKSCOPE_READONLY_PASSWORD"


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("readonly-user", parents=[common], help="the ClickHouse server user for the dashboard "
                       "and SQL console: SELECT only, read-only profile", description=__doc__)
    p.add_argument("--user", default="rankscope_reader", help="user name (default rankscope_reader)")
    p.add_argument("--apply", action="store_true", help="run the statements on the configured server DSN")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.storage.readonly_user import ReadonlyUserError, readonly_user_statements
    from rankscope.storage.store import DATABASE

    try:
        stmts = readonly_user_statements(DATABASE, args.user, os.environ.get(PASSWORD_ENV, ""))
    except ReadonlyUserError as e:
        hint = f" (set {PASSWORD_ENV})" if "password" in str(e) else ""
        print(f"rankscope readonly-user: error: {e}{hint}", file=sys.stderr)
        return 2
    if not args.apply:
        print(";\n".join(stmts) + ";")
        return 0
    if settings.embedded_store:
        print("rankscope readonly-user: error: the store is embedded (chDB), which has no users; the SQL "
              "console's guard keeps it read-only", file=sys.stderr)
        return 2
    from rankscope.storage.store import StoreError, close_store, open_store

    try:
        store = open_store(settings.store_dsn, apply=False)
        for stmt in stmts:
            store.command(stmt)
    except StoreError as e:
        print(f"rankscope readonly-user: error: {e}", file=sys.stderr)
        return 1
    finally:
        close_store(settings.store_dsn)
    print(f"user {args.user}: SELECT on {DATABASE}.*, settings profile rankscope_readonly")
    return 0
