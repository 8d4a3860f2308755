"""The SQL console: statement check, read-only execution on chDB, limits, examples, and the page."""

from __future__ import annotations

import pytest
import sample_data as sd
from pagetest import open_page, page_text

from rankscope.dashboard import queries as q
from rankscope.storage.store import StoreError

pytestmark = pytest.mark.clickhouse

WRITES = [
    "INSERT INTO rankscope.jobs (job, world_size, first_seen_ns, last_seen_ns) VALUES ('x', 1, 1, 1)",
    "INSERT INTO rankscope.jobs SELECT 'y', 1, 1, 1",
    "CREATE TABLE rankscope.evil (a Int32) ENGINE = Memory",
    "DROP TABLE rankscope.alerts",
    "ALTER TABLE rankscope.jobs DELETE WHERE 1",
    "TRUNCATE TABLE rankscope.jobs",
    "OPTIMIZE TABLE rankscope.steps FINAL",
    "SET readonly = 0",
    "SYSTEM DROP MARK CACHE",
    "RENAME TABLE rankscope.jobs TO rankscope.jobs2",
]


@pytest.mark.parametrize("sql", WRITES)
def test_check_refuses_writes_and_ddl(sql):
    with pytest.raises(q.SqlRefused, match="not allowed: the SQL is read-only"):
        q.check_readonly_sql(sql)


@pytest.mark.parametrize("sql, why", [
    ("SELECT 1; DROP TABLE rankscope.jobs", "one statement"),
    ("SELECT 1;;", "one statement"),
    ("SELECT 'a;b'", "one statement"),          # strict: ';' refused even inside a literal
    ("SELECT 1 INTO OUTFILE '/tmp/x.csv'", "INTO OUTFILE"),
    ("  -- only a comment\n", "empty"),
    ("", "empty"),
    ("(SELECT 1)", "not allowed"),
])
def test_check_refuses_tricks(sql, why):
    with pytest.raises(q.SqlRefused, match=why):
        q.check_readonly_sql(sql)


def test_check_accepts_reads_and_strips_comments_and_semicolon():
    assert q.check_readonly_sql("-- top\n/* block */ select 1 ;  \n") == "select 1"
    for sql in ("WITH 1 AS x SELECT x", "SHOW TABLES", "DESCRIBE TABLE steps", "DESC steps", "EXPLAIN SELECT 1",
                "# hash comment\nSELECT 2"):
        assert q.check_readonly_sql(sql)


@pytest.mark.parametrize("sql", WRITES[:6])
def test_chdb_session_refuses_writes_even_without_the_check(store, sql):
    """readonly=1 holds in chDB: a statement that got past the check would still be refused."""
    ro = q._console_client(store)
    for key, value in q.readonly_settings().items():
        ro.command(f"SET {key} = {value!r}")
    try:
        with pytest.raises(StoreError, match="READONLY|readonly"):
            ro.query_df(sql)
    finally:
        ro.close()
    tables = {r[0] for r in store.query_rows(f"SELECT name FROM system.tables WHERE database = '{store.database}'")}
    assert {"alerts", "jobs"} <= tables and "evil" not in tables
    assert store.query_rows(f"SELECT count() FROM {store.database}.jobs FINAL")[0][0] == 2


def test_run_readonly_select_works_and_shared_store_stays_writable(store):
    res = q.run_readonly(store, "SELECT job, count() AS n FROM steps GROUP BY job ORDER BY job")
    assert list(res.frame["job"]) == [sd.OK_JOB, sd.HANG_JOB] and not res.truncated
    empty = q.run_readonly(store, "SELECT * FROM rankscope.reports WHERE job = 'none'")
    assert empty.frame.empty and "body" in empty.frame.columns
    for sql in ("SELECT * FROM file('/etc/passwd', 'LineAsString')", "SELECT file('/etc/hostname')"):
        with pytest.raises(q.SqlRefused, match=r"file\(\) not allowed"):  # chDB reads file() even read-only
            q.run_readonly(store, sql)
    # The console used its own session: the shared one (the sink's, in `rankscope serve`) still writes.
    store.insert("deadletters", [{"ts_ns": 1, "source_topic": "t", "partition": 0, "offset": 1, "stage": "test",
                                  "reason": "r", "detail": "", "payload_b64": ""}])


def test_run_readonly_limits_rows_and_time(store):
    res = q.run_readonly(store, "SELECT number FROM system.numbers LIMIT 100000", max_rows=1000)
    assert len(res.frame) == 1000 and res.truncated
    with pytest.raises(StoreError, match="TIMEOUT_EXCEEDED|Timeout"):
        q.run_readonly(store, "SELECT count() FROM system.numbers", timeout_s=0.5)
    with pytest.raises(StoreError, match="readonly mode"):  # no raising the limits from inside the query
        q.run_readonly(store, "SELECT 1 SETTINGS max_result_rows = 0")


@pytest.mark.parametrize("name", list(q.SQL_EXAMPLES))
def test_saved_examples_run(store, name):
    res = q.run_readonly(store, q.SQL_EXAMPLES[name].format(db=store.database))
    assert not res.frame.empty, name


def test_examples_answer_what_they_say(store):
    ex = q.SQL_EXAMPLES
    slow = q.run_readonly(store, ex["Slowest ranks by median busy time (last 10 min)"].format(db=store.database)).frame
    assert (slow.iloc[0]["job"], slow.iloc[0]["rank"]) == (sd.HANG_JOB, 1)
    top = q.run_readonly(store, ex["Top functions by exclusive time in the latest window"].format(
        db=store.database)).frame
    assert top.iloc[0]["name"] == "backward" and top.iloc[0]["ranks"] == 4
    alerts = q.run_readonly(store, ex["Open alerts"].format(db=store.database)).frame
    assert set(alerts["alert_id"]) == {sd.HANG_ALERT_ID, sd.SLOW_ALERT_ID}


def test_sql_page_runs_a_select_and_offers_csv(app_env):
    at = open_page("views/sql.py")
    assert not at.exception, at.exception
    at.text_area(key="sql_text").input("SELECT job, world_size FROM jobs ORDER BY job").run()
    at.button[0].click().run()
    assert not at.exception, at.exception
    frame = at.dataframe[0].value
    assert list(frame["job"]) == [sd.OK_JOB, sd.HANG_JOB]
    assert "2 rows in" in page_text(at)
    assert at.get("download_button")


@pytest.mark.parametrize("sql, shown", [
    ("DROP TABLE jobs", "DROP is not allowed"),
    ("SELECT 1; DROP TABLE jobs", "one statement"),
    ("SELECT * FROM no_such_table", "UNKNOWN_TABLE"),
])
def test_sql_page_refuses_writes_calmly(app_env, store, sql, shown):
    at = open_page("views/sql.py")
    at.text_area(key="sql_text").input(sql).run()
    at.button[0].click().run()
    assert not at.exception, at.exception
    assert any(shown in e.value for e in at.error), [e.value for e in at.error]
    assert not at.dataframe
    assert store.query_rows(f"SELECT count() FROM {store.database}.jobs FINAL")[0][0] == 2


def test_sql_page_loads_an_example(app_env):
    at = open_page("views/sql.py")
    at.selectbox(key="sql_example").select("Open alerts").run()
    assert "FROM (SELECT * FROM rankscope.alerts" in at.text_area(key="sql_text").value
    at.button[0].click().run()
    assert not at.exception and sd.HANG_ALERT_ID in at.dataframe[0].value.to_string()
