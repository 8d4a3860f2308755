"""How a CLI command reads the store: serve's loopback query endpoint while serve holds the
embedded store (chDB admits one process per directory), else the store itself, or a ClickHouse
server's DSN directly (:func:`rankscope.storage.query_endpoint.open_read_store`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from rankscope.config import Settings

LOCKED_HINT = ("hint: the embedded store allows one process at a time, and the one holding it answers no queries "
               "(`rankscope serve` and `up` do; `rankscope sink` alone does not): stop `rankscope serve` or the "
               "sink and retry, or point --clickhouse-dsn at a ClickHouse server.")


def read_store(settings: Settings, read: Callable[[Any], Any], command: str, locked_hint: str = LOCKED_HINT) -> Any:
    """``read(store)``, or the exit status 1 after printing (as ``rankscope <command>``) why the
    store could not be read."""
    from rankscope.storage.query_endpoint import open_read_store
    from rankscope.storage.store import StoreError, StoreLocked

    try:
        store, release = open_read_store(settings.store_dsn, settings.data_dir)
    except StoreLocked as e:
        print(f"rankscope {command}: {e}\n{locked_hint}", file=sys.stderr)
        return 1
    except StoreError as e:
        print(f"rankscope {command}: error: {e}", file=sys.stderr)
        return 1
    try:
        return read(store)
    except StoreError as e:
        print(f"rankscope {command}: error: {e}", file=sys.stderr)
        return 1
    finally:
        release()
