"""A rank that fails ends the job: one rank_failed alert names it and how it ended.

Real torchrun ranks (gloo) -> real Kafka -> processors -> alerts topic and chDB. Rank 2 raises a
RuntimeError at step 40, or SIGKILLs itself at step 300 (as the OOM killer would: no exit record), while
its peers wait for it in all_reduce; they fail after it (the connection closes, or the launcher
stops them), and must be listed as followers, not culprits.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rankscope.config import Settings
from rankscope.protocol.alerts import Alert
from rankscope.storage.store import Store
from tests.integration.helpers import (
    REPO,
    AlertReader,
    child_env,
    free_port,
    start_job,
    stop_process,
    tail,
    wait_until,
)
from tests.integration.test_end_to_end import pipeline  # noqa: F401  (the module's stack)

pytestmark = [pytest.mark.kafka, pytest.mark.clickhouse, pytest.mark.torchrun]

PLAIN_DDP = Path(__file__).resolve().parent / "scripts" / "plain_ddp.py"


def test_raised_exception_gives_one_rank_failed_alert(pipeline: tuple[Settings, Store, Path]) -> None:  # noqa: F811
    settings, store, work = pipeline
    job = f"crash-{uuid.uuid4().hex[:6]}"
    log = work / f"{job}.log"
    reader = AlertReader(settings)
    proc = start_job(settings, job, log, "--steps", "100000", "--fail-rank", "2", "--fail-at-step", "40")
    try:
        assert wait_until(lambda: proc.poll() is not None, 180, "the job to end after the failure"), tail(log)
        assert proc.returncode != 0
        alert = reader.wait_for(lambda a: a.job == job and a.kind == "rank_failed", 120, "rank_failed",
                                on_timeout=lambda: tail(log))
        assert alert.ranks == [2] and alert.step == 40 and alert.severity == "critical", alert
        assert alert.details["exc_type"] == "RuntimeError", alert.details
        assert "illegal memory access" in alert.details["message"]
        assert any("load_batch" in f for f in alert.details["frames"]), alert.details["frames"]
        assert alert.stack_groups and alert.stack_groups[0].frames == alert.details["frames"]
        assert 2 not in alert.details["followers"]
        # Every peer fails after it and joins as a follower of the same incident.
        rank_2_failed_first_once(reader, store, job, alert)
    finally:
        stop_process(proc)
        reader.close()


def test_a_rank_killed_by_sigkill_is_named_and_its_peers_follow(pipeline: tuple[Settings, Store, Path]) -> None:  # noqa: F811
    settings, store, work = pipeline
    job = f"kill-{uuid.uuid4().hex[:6]}"
    log = work / f"{job}.log"
    reader = AlertReader(settings)
    cmd = [sys.executable, "-m", "rankscope", "run", "--job-id", job, "--",
           sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(PLAIN_DDP), "--steps", "100000", "--kill-rank", "2",
           "--kill-at-step", "300"]
    proc = subprocess.Popen(cmd, env=child_env(settings), cwd=REPO, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_until(lambda: proc.poll() is not None, 180, "the job to end after the kill"), tail(log)
        assert proc.returncode != 0 and "rank 2: SIGKILL at step 300" in log.read_text(errors="replace"), tail(log)
        alert = reader.wait_for(lambda a: a.job == job and a.kind == "rank_failed", 120, "rank_failed",
                                on_timeout=lambda: tail(log))
        assert alert.ranks == [2] and alert.severity == "critical", alert.summary
        assert alert.details["reason"] == "silent" and alert.details["ended"] == "silent: no exit record", alert.details
        # Iterations 0..299 done; the steps it had not yet sent when it died (up to a heartbeat's worth)
        # are lost with it. 300 steps take seconds, so some beats were sent before the kill.
        assert 1 <= alert.step <= 300 and alert.details["last_completed_step"] == alert.step - 1, alert.summary
        assert "rank 2 failed first" in alert.summary and "silent: no exit record" in alert.summary
        assert 2 not in alert.details["followers"]
        rank_2_failed_first_once(reader, store, job, alert)
    finally:
        stop_process(proc)
        reader.close()


def rank_2_failed_first_once(reader: AlertReader, store: Store, job: str, first: Alert) -> None:
    """Ranks 0, 1 and 3 end up as rank 2's followers in the same incident (``first``'s id), opened
    once and always naming rank 2; the stored copy answers SQL the same way."""
    last = reader.wait_for(lambda a: a.job == job and a.kind == "rank_failed"
                           and a.details["follower_count"] == 3, 120, "rank_failed with 3 followers")
    assert sorted(last.details["followers"]) == [0, 1, 3] and last.ranks == [2]
    mine = [a for a in reader.alerts(job) if a.kind == "rank_failed"]
    assert {a.alert_id for a in mine} == {first.alert_id} and all(a.ranks == [2] for a in mine)
    assert [a.status for a in mine].count("open") == 1
    rows = wait_until(lambda: store.query_rows(
        "SELECT ranks, kind FROM rankscope.alerts FINAL WHERE job = {job:String} AND kind = 'rank_failed'",
        parameters={"job": job}), 60, "the rank_failed alert in chDB")
    assert rows[0][0] == [2]
