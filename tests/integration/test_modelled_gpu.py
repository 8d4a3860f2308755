"""GPU-shaped jobs on CPU under ``rankscope run``: collectives never block the training thread.

The script (tests/integration/scripts/modelled_gpu.py) runs each rank's device work and its gloo
all-reduces on a stream thread and syncs once per step, as a NCCL job does: every rank shows the
same step time and no time blocked in torch.distributed, whichever device is slow or stopped. Real
torchrun ranks -> real Kafka -> processors -> alerts topic and chDB. "Named within 30 s" is measured
on the alert's ``opened_ns`` against the job's first stored step (event time).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankscope.cli.commands.export import FR_PREFIX, write_fr_dumps
from rankscope.config import Settings
from rankscope.storage.fr_dumps import collective_states, rank_dumps
from rankscope.storage.store import Store
from tests.integration.helpers import (
    AlertReader,
    processors_and_sink,
    rankscope_run,
    stop_process,
    tail,
    wait_until,
)
from tests.integration.test_run_attach import drain

pytestmark = [pytest.mark.kafka, pytest.mark.clickhouse, pytest.mark.torchrun]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "modelled_gpu.py"
RULES = {"RANKSCOPE_HANG_MIN_S": "6", "RANKSCOPE_STRAGGLER_MIN_S": "10"}

Stack = tuple[Settings, Store, Path]


@pytest.fixture(scope="module")
def stack(kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Fresh topics, a processors worker subprocess with RULES, and a sink thread writing chDB in tmp."""
    work = tmp_path_factory.mktemp("gpu")
    with processors_and_sink(kafka_settings, work, RULES) as (settings, store):
        yield settings, store, work


def run_job(settings: Settings, job: str, log: Path, *args: str, script: Path = SCRIPT,
            nproc: int = 4) -> subprocess.Popen[bytes]:
    """``rankscope run -- torchrun ... SCRIPT ARGS`` as a user would type it."""
    return rankscope_run(settings, job, log, script, *args, nproc=nproc, rules=RULES)


def diagnostics(work: Path, log: Path) -> str:
    return "job log:\n" + tail(log) + "\nprocessors log:\n" + tail(work / "processors.log")


def first_step_ns(store: Store, job: str) -> int:
    def first() -> int:
        rows = store.query_rows("SELECT min(start_ns) FROM rankscope.steps WHERE job = {job:String}",
                                parameters={"job": job})
        return int(rows[0][0]) if rows and rows[0][0] else 0

    return int(wait_until(first, 120, f"{job}'s steps in ClickHouse"))


def test_the_script_is_unmodified() -> None:
    text = SCRIPT.read_text()
    assert "rankscope" not in text.split('"""', 2)[2] and "Tracer" not in text


def test_a_slow_device_is_named_from_its_collectives(stack: Stack) -> None:
    settings, store, work = stack
    job = f"gpu-slow-{uuid.uuid4().hex[:6]}"
    log = work / f"{job}.log"
    reader = AlertReader(settings)
    proc = run_job(settings, job, log, "--steps", "100000", "--slow-device-rank", "2", "--slow-factor", "4")
    try:
        slow = reader.wait_for(lambda a: a.job == job and a.kind == "slow_rank" and a.status in ("open", "update"),
                               300, "slow_rank", lambda: diagnostics(work, log))
        assert slow.ranks == [2], slow.summary
        assert slow.details["process_group"] == "0" and slow.details["collective"].startswith("all_reduce"), \
            slow.details
        assert "all_reduce in process group 0" in slow.summary, slow.summary
        started = first_step_ns(store, job)
        timeline = store.query_rows(
            "SELECT rank, min(start_ns), min(end_ns), countIf(end_ns <= {t:Int64}) FROM rankscope.steps "
            "WHERE job = {job:String} GROUP BY rank ORDER BY rank", parameters={"job": job, "t": slow.opened_ns})
        shown = [(r, round((s - started) / 1e9, 2), round((e - started) / 1e9, 2), n) for r, s, e, n in timeline]
        print(f"slow device named {(slow.opened_ns - started) / 1e9:.1f} s after the first step; per rank "
              f"(first step start, its end, steps by then): {shown}")
        assert (slow.opened_ns - started) / 1e9 <= 30, ((slow.opened_ns - started) / 1e9, shown)
        assert proc.poll() is None, tail(log)
    finally:
        stop_process(proc)
        reader.close()


def test_a_stopped_device_is_the_only_rank_the_hang_names(stack: Stack) -> None:
    settings, store, work = stack
    job = f"gpu-stop-{uuid.uuid4().hex[:6]}"
    log = work / f"{job}.log"
    reader = AlertReader(settings)
    proc = run_job(settings, job, log, "--steps", "100000", "--stop-device-rank", "1", "--stop-at-step", "200")
    try:
        hang = reader.wait_for(lambda a: a.job == job and a.kind == "hang" and a.status in ("open", "update"),
                               300, "hang", lambda: diagnostics(work, log))
        assert hang.ranks == [1], hang.summary
        coll = hang.details["collective"]
        assert coll["process_group"] == "0" and coll["op"].startswith("all_reduce float32["), coll
        assert "never reached" in hang.summary, hang.summary
        # Every rank's training thread waits at the same sync: the stacks alone could not tell.
        hang = reader.wait_for(lambda a: a.alert_id == hang.alert_id
                               and sorted(r for g in a.stack_groups for r in g.ranks) == [0, 1, 2, 3],
                               120, "the hang with every rank's stack", lambda: diagnostics(work, log))
        assert hang.ranks == [1], hang.summary
        assert len({tuple(g.frames) for g in hang.stack_groups}) == 1, hang.stack_groups
        # The hang asked every rank for its Flight Recorder dump; the sink stored them.
        request = f"flight-{hang.alert_id}"
        def four_dumps() -> dict | None:
            d = rank_dumps(store, job, request)
            return d if len(d) == 4 else None

        try:
            dumps = wait_until(four_dumps, 120, "four ranks' Flight Recorder dumps in ClickHouse")
        except AssertionError as e:
            stored = store.query_rows("SELECT request_id, rank FROM rankscope.fr_dumps WHERE job = {job:String}",
                                      parameters={"job": job})
            dead = store.query_rows("SELECT reason, detail FROM rankscope.deadletters ORDER BY ts_ns DESC LIMIT 5")
            raise AssertionError(f"{e}; stored {stored}; dead letters {dead}; want {request}") from None
        states = collective_states(dumps)
        default = states[states["process_group"] == "0"].set_index("rank")["last_enqueued"]
        assert default[1] == default[0] - 1 and default[0] == default[2] == default[3], states
    finally:
        stop_process(proc)
        reader.close()
    # PyTorch's own analyzer reads the exported dumps and finds the collective rank 1 never joined.
    folder = work / f"{job}-fr"
    write_fr_dumps(dumps, folder)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder),
                          "--prefix", FR_PREFIX], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "Not all ranks joining collective" in text and "missing ranks: {1}" in text, text[-3000:]


def test_a_stopped_training_thread_is_named(stack: Stack) -> None:
    settings, _store, work = stack
    job = f"gpu-hosthang-{uuid.uuid4().hex[:6]}"
    log = work / f"{job}.log"
    reader = AlertReader(settings)
    proc = run_job(settings, job, log, "--steps", "100000", "--hang-rank", "3", "--hang-at-step", "200")
    try:
        hang = reader.wait_for(lambda a: a.job == job and a.kind == "hang" and a.status in ("open", "update"),
                               300, "hang", lambda: diagnostics(work, log))
        assert hang.ranks == [3], hang.summary
        hang = reader.wait_for(lambda a: a.alert_id == hang.alert_id and any(
            3 in g.ranks and any("modelled_gpu.py" in f and "main" in f for f in g.frames) for g in a.stack_groups),
            120, "the culprit's stack", lambda: diagnostics(work, log))
        assert hang.ranks == [3], hang.summary
    finally:
        stop_process(proc)
        reader.close()


def test_a_mismatched_collective_is_named_with_both_shapes(stack: Stack) -> None:
    settings, _store, work = stack
    job = f"gpu-mismatch-{uuid.uuid4().hex[:6]}"
    log = work / f"{job}.log"
    reader = AlertReader(settings)
    # The odd rank stays on its code path (the script's default): rankscope samples the newest
    # coll_ring collectives every coll_read_s, so a mismatch over in less (200 steps ran in 1.7 s
    # here) may fall between two reads.
    proc = run_job(settings, job, log, "--steps", "100000", "--mismatch-rank", "3", "--mismatch-at-step", "150")
    try:
        alert = reader.wait_for(lambda a: a.job == job and a.kind == "collective_mismatch", 300,
                                "collective_mismatch", lambda: diagnostics(work, log))
        assert alert.ranks == [3], alert.summary
        d = alert.details
        assert d["process_group"] == "0" and d["rank"] == 3 and d["peer"] != 3, d
        assert d["op"].startswith("all_reduce float32[1,") and d["peer_op"].startswith("all_reduce float32["), d
        assert d["op"] != d["peer_op"], d
        assert d["op"] in alert.summary and d["peer_op"] in alert.summary, alert.summary
    finally:
        stop_process(proc)
        reader.close()


def test_a_healthy_modelled_gpu_run_raises_nothing(stack: Stack) -> None:
    settings, store, work = stack
    job = f"gpu-ok-{uuid.uuid4().hex[:6]}"
    log = work / f"{job}.log"
    proc = run_job(settings, job, log, "--steps", "1501", "--min-seconds", "31")
    assert proc.wait(900) == 0, tail(log)
    alerts = AlertReader(settings)

    def stored() -> tuple | None:
        row = tuple(store.query_rows("SELECT count(), max(step), (max(end_ns) - min(start_ns)) / 1e9 "
                                     "FROM rankscope.steps FINAL WHERE job = {job:String}", parameters={"job": job})[0])
        return row if row[0] >= 4 * 1500 else None

    count, top, seconds = wait_until(stored, 120, "the healthy job's steps in ClickHouse")
    assert top >= 1500 and seconds >= 30, (count, top, seconds)
    wait_until(lambda: store.query_rows("SELECT count() FROM rankscope.ranks FINAL WHERE job = {job:String} "
                                        "AND exit_reason = 'completed'", parameters={"job": job})[0][0] == 4,
               120, "four completed ranks")
    drain(alerts, 120)
    assert alerts.alerts(job) == [], [a.summary for a in alerts.alerts(job)]
    alerts.close()


@pytest.mark.parametrize("script,kill_step", [(SCRIPT, 50), (SCRIPT, 300),
                                              (SCRIPT.parent / "plain_ddp.py", 50),
                                              (SCRIPT.parent / "plain_ddp.py", 300)],
                         ids=["modelled-50", "modelled-300", "ddp-50", "ddp-300"])
def test_a_sigkilled_rank_is_named_first_and_its_peers_follow(stack: Stack, script: Path, kill_step: int) -> None:
    settings, _store, work = stack
    job = f"gpu-kill-{kill_step}-{uuid.uuid4().hex[:6]}"
    log = work / f"{job}.log"
    reader = AlertReader(settings)
    proc = run_job(settings, job, log, "--steps", "100000", "--kill-rank", "3", "--kill-at-step", str(kill_step),
                   script=script)
    try:
        alert = reader.wait_for(lambda a: a.job == job and a.kind == "rank_failed", 240, "rank_failed",
                                lambda: diagnostics(work, log))
        assert alert.ranks == [3], alert.summary
        assert alert.details["reason"] == "silent", alert.details
        alert = reader.wait_for(lambda a: a.alert_id == alert.alert_id and a.details["follower_count"] >= 1,
                                120, "rank_failed with its followers", lambda: diagnostics(work, log))
        assert alert.ranks == [3] and 3 not in alert.details["followers"], alert.details
    finally:
        stop_process(proc)
        reader.close()
