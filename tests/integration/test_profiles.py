"""Always-on profiles under ``rankscope run``: real torchrun ranks (gloo) sample their stacks, the
sink keeps them in chDB, and what one rank does that its peers don't is on top of its differential;
DataLoader worker processes are sampled under their rank as ``dataloader``; the export writes
folded stacks, speedscope and pprof."""

from __future__ import annotations

import gzip
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankscope import profiles
from rankscope.cli import main
from rankscope.config import Settings
from rankscope.storage.profiles import profile_rows
from rankscope.storage.store import Store
from tests.integration.helpers import (
    AlertReader,
    processors_and_sink,
    rankscope_run,
    stop_process,
    tail,
    wait_until,
)

pytestmark = [pytest.mark.kafka, pytest.mark.clickhouse, pytest.mark.torchrun]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "plain_ddp.py"
# No automatic trace window: what the slow-rank alert says of the slow rank's code comes from profiles.
RULES = {"RANKSCOPE_PROFILE_HZ": "20", "RANKSCOPE_PROFILE_S": "5", "RANKSCOPE_STRAGGLER_MIN_S": "10",
         "RANKSCOPE_AUTO_TRACE_STEPS": "0"}
EXTRA = "tokenize_captions"
GETITEM = "Samples.__getitem__"

Stack = tuple[Settings, Store, Path]


@pytest.fixture(scope="module")
def stack(kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("profiles")
    with processors_and_sink(kafka_settings, work, RULES) as (settings, store):
        yield settings, store, work


@pytest.fixture(scope="module")
def job(stack: Stack) -> Iterator[str]:
    """One 4-rank job, at least 25 s: rank 1 spends 20 ms a step in a function no other rank calls,
    rank 2 loads its batches in two DataLoader workers whose ``__getitem__`` is slow."""
    settings, _store, work = stack
    name = f"profile-{uuid.uuid4().hex[:6]}"
    log = work / f"{name}.log"
    proc = rankscope_run(settings, name, log, SCRIPT, "--steps", "300", "--min-seconds", "25",
                         "--extra-rank", "1", "--extra-ms", "20", "--slow-data-rank", "2", "--slow-data-s", "0.03",
                         "--workers", "2", rules=RULES)
    try:
        assert wait_until(lambda: proc.poll() is not None, 300, "the job to end"), tail(log)
        assert proc.returncode == 0, tail(log)
        yield name
    finally:
        stop_process(proc)


def stored(store: Store, job: str, **kw) -> profiles.pd.DataFrame:
    return profiles.seconds(profile_rows(store, job, **kw))


def test_the_function_only_one_rank_calls_tops_its_differential(stack: Stack, job: str) -> None:
    _settings, store, _work = stack
    (per,) = wait_until(lambda: (lambda df: (df,) if df["rank"].nunique() == 4 and df["path"].str.contains(EXTRA).any()
                                 else None)(stored(store, job, roles=["training"])), 120, "four ranks' profiles")
    per = per.groupby(["rank", "path"], as_index=False)["seconds"].sum()
    diff = profiles.differential(per, [1])
    top = diff.iloc[0]
    # The innermost frame that grew: the function or code inside it (its qualname says so).
    line = next(i + 1 for i, text in enumerate(SCRIPT.read_text().splitlines()) if text.startswith(f"def {EXTRA}("))
    assert f" {EXTRA}" in top["function"] and f"plain_ddp.py:{line} {EXTRA}" in top["path"], diff.head(5).to_string()
    # ~20 ms of each ~(20 + x) ms step over >= 25 s: seconds of it, and none on the peers.
    assert top["added_s"] > 3 and top["peers_median_s"] == 0, diff.head(5).to_string()
    assert not per[per["rank"] != 1]["path"].str.contains(EXTRA).any()


def test_the_slow_rank_alert_names_that_function_without_a_trace_window(stack: Stack, job: str) -> None:
    settings, store, _work = stack
    reader = AlertReader(settings)
    try:
        alert = reader.wait_for(lambda a: a.job == job and a.kind == "slow_rank" and bool(a.details.get("profile")),
                                120, "of the slow rank naming a call path from its profile")
        first = next(a for a in reader.alerts(job) if a.kind == "slow_rank")
    finally:
        reader.close()
    assert alert.ranks == [1] and first.ranks == [1], alert.summary
    top = alert.details["profile"][0]
    assert f" {EXTRA}" in top["function"] and top["peers_median_share"] == 0, alert.details["profile"]
    assert EXTRA in alert.summary
    windows = store.query_rows("SELECT count() FROM rankscope.trace_windows WHERE job = {j:String}",
                               parameters={"j": job})[0][0]
    assert windows == 0
    first_step_ns = store.query_rows("SELECT min(start_ns) FROM rankscope.steps WHERE job = {j:String}",
                                     parameters={"j": job})[0][0]
    print(f"the slow-rank alert named {top['function']} {(alert.updated_ns - first_step_ns) / 1e9:.1f} s after "
          f"the job's first step (profile_s {RULES['RANKSCOPE_PROFILE_S']})")


def test_dataloader_workers_are_sampled_under_their_rank(stack: Stack, job: str) -> None:
    _settings, store, _work = stack
    (rows,) = wait_until(lambda: (lambda df: (df,) if df["path"].str.contains(GETITEM).any() else None)(
        profile_rows(store, job, roles=["dataloader"])), 120, "the workers' profiles")
    slow = rows[rows["path"].str.contains(GETITEM)]
    by_rank = slow.groupby("rank")["samples"].sum() / slow.groupby("rank")["hz"].first()
    assert by_rank.idxmax() == 2 and by_rank[2] > 3, by_rank
    pids = store.query_rows("SELECT uniqExact(pid) FROM rankscope.profile_samples WHERE job = {j:String} AND rank = 2",
                            parameters={"j": job})[0][0]
    assert pids >= 3          # the rank's own process and its two workers


def test_export_writes_folded_speedscope_and_pprof(stack: Stack, job: str, tmp_path: Path) -> None:
    settings, store, _work = stack
    wait_until(lambda: not profile_rows(store, job).empty, 120, "stored profiles")
    out = tmp_path / "prof"
    # In this process: the sink thread holds the embedded store, which admits one process at a time.
    assert main(["export", "--job", job, "--profile", "-o", str(out), "--clickhouse-dsn", settings.clickhouse_dsn,
                 "--data-dir", settings.data_dir]) == 0
    folded = (out / "profile.folded").read_text().splitlines()
    assert any(line.startswith("rank_1;") and EXTRA in line for line in folded)
    doc = json.loads((out / "profile.speedscope.json").read_text())
    assert {p["name"] for p in doc["profiles"]} == {"rank 0", "rank 1", "rank 2", "rank 3"}
    assert gzip.decompress((out / "profile.pb.gz").read_bytes())
