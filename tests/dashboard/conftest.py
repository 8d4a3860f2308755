"""Fixtures of the dashboard tests: a real embedded store (chDB) filled with sample_data.

chDB opens one data directory per process at a time, so each test module shares one store
(module scope) and closes it at the end, before the next module opens its own.
"""

from __future__ import annotations

import pytest
import sample_data as sd
import streamlit as st

from rankscope.dashboard import ui
from rankscope.storage.store import Store, apply_schema, close_store, open_store


@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory):
    dsn = f"chdb://{tmp_path_factory.mktemp('dash') / 'clickhouse'}"
    store = open_store(dsn)
    now = sd.populate(store)
    yield store, now
    ui._store.clear()
    close_store(dsn)


@pytest.fixture
def store(populated) -> Store:
    return populated[0]


@pytest.fixture
def now(populated) -> int:
    return populated[1]


@pytest.fixture(scope="module")
def empty_store(populated) -> Store:
    """A second database in the same engine, with the schema and no rows."""
    s = Store(populated[0]._client, populated[0].dsn, database="rankscope_empty")
    apply_schema(s)
    return s


@pytest.fixture
def app_env(populated, monkeypatch, tmp_path):
    monkeypatch.setenv("RANKSCOPE_CLICKHOUSE_DSN", populated[0].dsn)
    monkeypatch.setenv("RANKSCOPE_DATA_DIR", str(tmp_path))
    # The sample heartbeats stop when populated; keep ranks alive for the length of the module.
    monkeypatch.setenv("RANKSCOPE_DEAD_AFTER_S", "3600")
    st.cache_data.clear()
    yield
    st.cache_data.clear()
