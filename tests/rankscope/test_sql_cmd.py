"""``rankscope sql``, the guard it shares with the console, and serve's query endpoint, on a real chDB store."""

from __future__ import annotations

import json
import stat
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankscope.cli import main
from rankscope.sql_guard import SqlRefused, called_functions, check_readonly_sql

pytestmark = pytest.mark.clickhouse

REFUSED = [
    ("INSERT INTO jobs SELECT 'y', 1, 1, 1", "INSERT is not allowed"),
    ("CREATE TABLE evil (a Int32) ENGINE = Memory", "CREATE is not allowed"),
    ("DROP TABLE steps", "DROP is not allowed"),
    ("SELECT * FROM file('/etc/passwd', 'LineAsString')", r"file\(\) not allowed"),
    ("SELECT file('/etc/passwd')", r"file\(\) not allowed"),
    ("SELECT * FROM FILE ('/etc/passwd')", r"FILE\(\) not allowed"),
    ("SELECT * FROM `file`('/etc/passwd')", r"file\(\) not allowed"),
    ('SELECT * FROM "url"(\'http://127.0.0.1:9/\', CSV)', r"url\(\) not allowed"),
    ("SELECT * FROM url('http://127.0.0.1:9/x', 'CSV', 'a String')", r"url\(\) not allowed"),
    ("WITH x AS (SELECT * FROM s3('http://127.0.0.1:9/b/k')) SELECT * FROM x", r"s3\(\) not allowed"),
    ("SELECT * FROM remote('127.0.0.1:9000', system.one)", r"remote\(\) not allowed"),
    ("SELECT * FROM mysql('127.0.0.1:3306', 'db', 't', 'u', 'p')", r"mysql\(\) not allowed"),
    ("SELECT * FROM postgresql('127.0.0.1:5432', 'db', 't', 'u', 'p')", r"postgresql\(\) not allowed"),
    ("SELECT * FROM hdfs('hdfs://127.0.0.1:9000/x', 'CSV')", r"hdfs\(\) not allowed"),
    ("SELECT * FROM input('a String')", r"input\(\) not allowed"),
    ("DESCRIBE TABLE file('/etc/passwd')", r"file\(\) not allowed"),
    ("SELECT * FROM Python(df)", r"Python\(\) not allowed"),
    ("SELECT 1 INTO OUTFILE '/tmp/x.csv'", "INTO OUTFILE"),
    ("SELECT 1 #x\n, file('/etc/passwd')", r"file\(\) not allowed"),   # '#x' is no comment
    ("SELECT 1 /* a */ , `file` /* b */ ('/etc/passwd')", r"file\(\) not allowed"),
]


@pytest.mark.parametrize("sql, why", REFUSED)
def test_guard_refuses_writes_ddl_and_outside_reads(sql: str, why: str) -> None:
    with pytest.raises(SqlRefused, match=why):
        check_readonly_sql(sql)


def test_guard_looks_at_calls_not_at_names_in_strings_comments_or_columns() -> None:
    for sql in ("SELECT 'file(/etc/passwd)' AS s", "SELECT 1 -- url('x')", "SELECT 1 /* s3(x) */",
                "SELECT file, url FROM t", "SELECT count(url) FROM t", "SELECT 'it''s' AS file"):
        assert check_readonly_sql(sql) == sql
    assert called_functions("SELECT count(x), `file` (y), 'z(' FROM numbers(3)") == ["count", "file", "numbers"]


@pytest.fixture
def store_dsn(tmp_path: Path) -> Iterator[str]:
    from rankscope.storage.store import close_store, open_store

    dsn = f"chdb://{tmp_path / 'ch'}"
    store = open_store(dsn)
    store.insert("jobs", [{"job": "jobA", "world_size": 2, "first_seen_ns": 1, "last_seen_ns": 2},
                          {"job": "jobB", "world_size": 8, "first_seen_ns": 1, "last_seen_ns": 3}])
    close_store(dsn)
    yield dsn
    close_store(dsn)


def sql(capsys: pytest.CaptureFixture[str], dsn: str, data_dir: Path, *args: str) -> tuple[int, str, str]:
    rc = main(["sql", *args, "--clickhouse-dsn", dsn, "--data-dir", str(data_dir)])
    out = capsys.readouterr()
    return rc, out.out, out.err


QUERY = "SELECT job, world_size FROM jobs FINAL ORDER BY job"


def test_sql_prints_table_csv_and_json(store_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = sql(capsys, store_dsn, tmp_path, QUERY)
    assert rc == 0 and out.split() == ["job", "world_size", "jobA", "2", "jobB", "8"], err
    assert "2 rows in" in err
    rc, out, _ = sql(capsys, store_dsn, tmp_path, QUERY, "--format", "csv")
    assert rc == 0 and out.splitlines() == ["job,world_size", "jobA,2", "jobB,8"]
    rc, out, _ = sql(capsys, store_dsn, tmp_path, QUERY, "--format", "json")
    assert rc == 0 and json.loads(out) == [{"job": "jobA", "world_size": 2}, {"job": "jobB", "world_size": 8}]
    rc, out, err = sql(capsys, store_dsn, tmp_path, "SELECT number FROM system.numbers LIMIT 50", "--max-rows", "10")
    assert rc == 0 and len(out.splitlines()) == 11 and "only the first 10" in err


@pytest.mark.parametrize("statement", [s for s, _ in REFUSED[:5]])
def test_sql_refuses_with_status_2(store_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   statement: str) -> None:
    rc, out, err = sql(capsys, store_dsn, tmp_path, statement)
    assert rc == 2 and out == "" and "rankscope sql: error: refused:" in err


def test_sql_reports_clickhouse_errors_with_status_1(store_dsn: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = sql(capsys, store_dsn, tmp_path, "SELECT * FROM no_such_table")
    assert rc == 1 and "UNKNOWN_TABLE" in err


@pytest.fixture
def endpoint(store_dsn: str, tmp_path: Path):
    """Serve's query endpoint in this process, holding the store (as ``rankscope serve`` does)."""
    from rankscope.storage.query_endpoint import QueryEndpoint
    from rankscope.storage.store import close_store, open_store

    ep = QueryEndpoint(open_store(store_dsn), tmp_path).start()
    yield ep
    ep.stop()
    close_store(store_dsn)


def test_endpoint_file_is_private_and_the_token_is_required(endpoint, tmp_path: Path) -> None:
    from rankscope.storage.query_endpoint import endpoint_path

    path = endpoint_path(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    info = json.loads(path.read_text())
    assert info["port"] == endpoint.port and len(info["token"]) >= 32
    for auth in ("", "Bearer ", f"Bearer {info['token']}x"):
        req = urllib.request.Request(f"http://127.0.0.1:{info['port']}/query", data=b'{"sql": "SELECT 1"}',
                                     method="POST", headers={"Authorization": auth} if auth else {})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 401


def test_sql_goes_through_the_endpoint(endpoint, store_dsn: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """This process holds the store and answers on its endpoint; the command's answer comes over HTTP
    (the endpoint records the statements it served)."""
    from rankscope.storage.query_endpoint import endpoint_for, query

    served = []
    answer = endpoint.answer
    endpoint.answer = lambda body: (served.append(body["sql"]), answer(body))[1]
    rc, out, err = sql(capsys, store_dsn, tmp_path, QUERY, "--format", "json")
    assert rc == 0 and json.loads(out)[1] == {"job": "jobB", "world_size": 8}, err
    assert served == [QUERY]
    rc, _, err = sql(capsys, store_dsn, tmp_path, "SELECT file('/etc/passwd')")
    assert rc == 2 and "refused" in err
    # The endpoint applies the guard itself too, whatever the client checked.
    ep = endpoint_for(tmp_path, store_dsn)
    assert ep is not None and ep.port == endpoint.port
    with pytest.raises(SqlRefused, match=r"url\(\) not allowed"):
        query(ep, "SELECT * FROM url('http://127.0.0.1:9/', 'CSV', 'a String')")
    res = query(ep, "SELECT number FROM system.numbers LIMIT 20", max_rows=5)
    assert len(res.frame) == 5 and res.truncated
    assert endpoint_for(tmp_path, "chdb:///some/other/dir") is None


def test_endpoint_store_serves_the_dashboards_queries(endpoint, store_dsn: str, tmp_path: Path) -> None:
    from rankscope.dashboard import queries
    from rankscope.storage.query_endpoint import open_read_store

    store, release = open_read_store(store_dsn, tmp_path)
    try:
        assert type(store).__name__ == "EndpointStore"
        jobs = queries.jobs(store)
        assert sorted(jobs["job"]) == ["jobA", "jobB"]
        assert queries.trace_windows(store, "jobA").empty
    finally:
        release()
