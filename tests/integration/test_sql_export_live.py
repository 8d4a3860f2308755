"""``rankscope sql``, ``export`` and ``report`` while ``rankscope up`` runs (its serve holds the embedded store).

Real parts: the fixtures' Kafka broker, ``rankscope up`` (a supervisor running processors and
serve: sink + dashboard + the loopback query endpoint) on embedded chDB, a shared trace set replayed into it with
``rankscope replay``, and the two commands as child processes (they cannot open the store: serve
holds it).
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from rankscope.config import Settings
from rankscope.storage.query_endpoint import endpoint_path
from tests.integration.helpers import REPO, child_env, free_port, tail, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.clickhouse]

TRACES = sorted((REPO / "tests" / "data" / "hta_sampled2").glob("*.json.gz"))
JOB, WINDOW = "live-sql", "rpsqlexport-0"
REFUSED = [
    "INSERT INTO rankscope.jobs (job, world_size, first_seen_ns, last_seen_ns) VALUES ('x', 1, 1, 1)",
    "CREATE TABLE rankscope.evil (a Int32) ENGINE = Memory",
    "DROP TABLE rankscope.steps",
    "SELECT * FROM file('/etc/passwd', 'LineAsString')",
    "SELECT file('/etc/passwd')",
    "SELECT * FROM url('http://127.0.0.1:9/x', 'CSV', 'a String')",
]


def cli(settings: Settings, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rankscope", *args], env=child_env(settings), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)


def sql_json(settings: Settings, statement: str) -> list[dict]:
    out = cli(settings, "sql", statement, "--format", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def served(fresh_topics: Settings, tmp_path: Path):
    """``rankscope up`` on the fixtures' broker: the supervisor runs processors and serve, and serve
    holds the embedded store; ``rankscope down`` at the end."""
    settings = fresh_topics.with_overrides(bootstrap_servers=fresh_topics.bootstrap, data_dir=str(tmp_path),
                                           clickhouse_dsn=f"chdb://{tmp_path / 'ch'}",
                                           dashboard_port=free_port(), sink_group=f"sql-{uuid.uuid4().hex[:8]}",
                                           sink_batch_s=0.2, metrics_port_processors=0, metrics_port_serve=0,
                                           report_deadline_s=5.0)   # a replayed window has no live ranks to wait for
    up = cli(settings, "up", timeout_s=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        wait_until(lambda: endpoint_path(tmp_path).exists(), 120, "serve's query endpoint")
        yield settings
    finally:
        down = cli(settings, "down", timeout_s=120)
        for log in sorted((tmp_path / "logs").glob("*.log")):
            print(f"{log.name}:\n" + tail(log))
        assert down.returncode == 0, down.stdout + down.stderr
    assert not endpoint_path(tmp_path).exists()   # serve removed its endpoint file on the way out


def test_sql_and_export_go_through_serve(served: Settings, tmp_path: Path):
    settings = served
    info_file = endpoint_path(tmp_path)
    assert stat.S_IMODE(info_file.stat().st_mode) == 0o600
    info = json.loads(info_file.read_text())

    # The endpoint wants the token.
    req = urllib.request.Request(f"http://127.0.0.1:{info['port']}/query", data=b'{"sql": "SELECT 1"}',
                                 method="POST", headers={"Authorization": "Bearer wrong"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401

    # Answers, in all three formats.
    assert sql_json(settings, "SELECT 41 + 1 AS answer") == [{"answer": 42}]
    csv = cli(settings, "sql", "SELECT name FROM system.tables WHERE database = 'rankscope' AND name = 'steps'",
              "--format", "csv")
    assert csv.returncode == 0 and csv.stdout.splitlines() == ["name", "steps"], csv.stderr
    table = cli(settings, "sql", "SHOW TABLES")
    assert table.returncode == 0 and "trace_events" in table.stdout, table.stderr

    # Refuses writes, DDL and table functions that read files or the network, with status 2.
    for statement in REFUSED:
        out = cli(settings, "sql", statement)
        assert out.returncode == 2, (statement, out.stdout, out.stderr)
        assert "refused" in out.stderr, out.stderr
    assert sql_json(settings, "SELECT count() AS n FROM system.tables WHERE database = 'rankscope' "
                              "AND name = 'evil'") == [{"n": 0}]

    # A shared trace set replayed into the stack; the sink stores its events.
    out = cli(settings, "replay", *map(str, TRACES), "--job", JOB, "--window-id", WINDOW)
    assert out.returncode == 0, out.stdout + out.stderr

    def stored() -> int:
        rows = sql_json(settings, f"SELECT count() AS n, uniqExact(rank) AS ranks FROM trace_events "
                                  f"WHERE job = '{JOB}' AND window_id = '{WINDOW}'")
        windows = sql_json(settings, f"SELECT toInt64(sum(events)) AS sent FROM (SELECT * FROM trace_windows "
                                     f"WHERE job = '{JOB}' AND window_id = '{WINDOW}' "
                                     "ORDER BY updated_ns DESC LIMIT 1 BY rank)")
        n, ranks = rows[0]["n"], rows[0]["ranks"]
        return n if ranks == len(TRACES) and n > 0 and n == windows[0]["sent"] else 0

    n_events = wait_until(stored, 180, "the replayed window's events in the store")

    target = tmp_path / "window.trace.json"
    out = cli(settings, "export", "--job", JOB, "--window", WINDOW, "-o", str(target))
    assert out.returncode == 0, out.stderr
    assert f"{n_events} events from {len(TRACES)} ranks" in out.stdout, out.stdout
    trace = json.loads(target.read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == n_events
    starts = {e["id"] for e in trace["traceEvents"] if e["ph"] == "s"}
    assert starts and starts == {e["id"] for e in trace["traceEvents"] if e["ph"] == "f"}   # launch -> kernel
    kineto = tmp_path / "kineto"
    out = cli(settings, "export", "--job", JOB, "--window", WINDOW, "--format", "kineto", "-o", str(kineto))
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in kineto.glob("*.json.gz")) == [f"rank-{r}.json.gz" for r in range(len(TRACES))]

    # The window's diagnosis report as the store keeps it (the processors built it at their report
    # deadline, the sink stored it): `rankscope report` reads it through serve, as the dashboard does.
    out = cli(settings, "report", "--job", JOB, "--window", WINDOW, "--format", "json", "--timeout", "180",
              timeout_s=300)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["job"] == JOB and rep["window_id"].startswith(WINDOW), (rep["job"], rep["window_id"])
    assert rep["window_id"] == sql_json(settings, f"SELECT window_id FROM reports WHERE job = '{JOB}'")[0]["window_id"]
    written = tmp_path / "report"
    out = cli(settings, "report", "--job", JOB, "--output-dir", str(written))
    assert out.returncode == 0, out.stderr
    assert sorted(p.suffix for p in written.iterdir()) == [".json", ".md"], out.stdout
    assert json.loads(next(written.glob("*.json")).read_text()) == rep
    out = cli(settings, "report", "--job", "no-such-job")
    assert out.returncode == 2 and "no report for job 'no-such-job' in the store" in out.stderr, out.stderr
