"""``rankscope export --fr-dump`` against a real chDB store in tmp, and ``rankscope flight``'s
arguments and its request on a real broker."""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankscope.cli import main
from rankscope.config import Settings
from rankscope.protocol.envelope import decode
from rankscope.topics import Topic
from tests.integration.helpers import TopicReader, wait_until

T0 = (time.time_ns() // 10**9 - 60) * 10**9


def dump(rank: int, last: int) -> str:
    entries = [{"record_id": s, "process_group": ["0", "default_pg"], "collective_seq_id": s, "profiling_name": "gloo:all_reduce"}
               for s in range(1, last + 1)]
    return json.dumps({"version": "2.10", "pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1]"}},
                       "pg_status": {"0": {"last_enqueued_collective": last}}, "entries": entries})


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[str]:
    from rankscope.storage.store import close_store, open_store

    dsn = f"chdb://{tmp_path / 'ch'}"
    store = open_store(dsn)
    store.insert("fr_dumps", [
        {"job": "jobA", "rank": r, "ts_ns": T0 + r, "request_id": req, "reason": "alert", "host": "h", "pid": r,
         "truncated": 0, "dump": dump(r, last)}
        for req, lasts in (("flight-old", (3, 3)), ("flight-jobA:hang:9", (7, 6))) for r, last in enumerate(lasts)])
    store.insert("fr_dumps", [{"job": "jobA", "rank": 0, "ts_ns": T0 + 10, "request_id": "flight-jobA:hang:9",
                               "reason": "alert", "host": "h", "pid": 0, "truncated": 0, "dump": dump(0, 7)}])
    close_store(dsn)
    try:
        yield dsn
    finally:
        close_store(dsn)


@pytest.mark.clickhouse
def test_export_writes_each_ranks_dump_as_the_analyzer_reads_it(stored: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fr"
    rc = main(["export", "--clickhouse-dsn", stored, "--job", "jobA", "--fr-dump", "--window", "flight-jobA", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    files = sorted(p.name for p in out.iterdir())
    assert files == ["rank_0", "rank_1"]
    ranks = {int(p.name[5:]): pickle.loads(p.read_bytes()) for p in out.iterdir()}
    assert len(ranks[0]["entries"]) == 7 and len(ranks[1]["entries"]) == 6
    assert ranks[1]["pg_config"]["0"]["ranks"] == "[0, 1]"
    assert "fr_trace" in capsys.readouterr().out


@pytest.mark.clickhouse
def test_export_without_dumps_says_how_to_get_them(stored: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--clickhouse-dsn", stored, "--job", "nope", "--fr-dump", "-o", str(tmp_path / "x")]) == 1
    assert "rankscope flight" in capsys.readouterr().err
    assert main(["export", "--clickhouse-dsn", stored, "--fr-dump"]) == 2


def test_flight_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["flight", "--job", "j", "--ranks", "3-1"]) == 2
    assert "bad rank range" in capsys.readouterr().err
    assert main(["flight", "--job", "j", "--timeout", "0"]) == 2


@pytest.mark.kafka
def test_flight_sends_the_request_and_says_when_no_rank_answers(fresh_topics: Settings,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    control = TopicReader(fresh_topics, Topic.CONTROL)
    args = ["flight", "--bootstrap-servers", fresh_topics.bootstrap, "--topic-prefix", fresh_topics.topic_prefix,
            "--job", "jobZ", "--ranks", "0-1", "--timeout", "2"]
    assert main(args) == 1
    out = capsys.readouterr()
    assert "no answer in 2s from ranks 0,1" in out.err and "--fr-dump" in out.out

    def request() -> dict | None:
        control.poll(0.5)
        bodies = [decode(v).body for v in control.values]
        return next((b for b in bodies if b["command"] == "flight"), None)

    body = wait_until(request, 30, "the flight request on the control topic")
    assert body["ranks"] == [0, 1] and body["request_id"].startswith("flight-cli-")
    control.close()
