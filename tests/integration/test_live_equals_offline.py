"""The live diagnosis equals the offline one: the shared trace sets replayed into real processors
(real Kafka broker) give the report ``rankscope analyze`` gives for the same files."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from rankscope.config import Settings
from tests.integration.replayed import offline_report, processors, replayed_report
from tests.offline.trace_sets import DATA, slow_rank_set

pytestmark = pytest.mark.kafka

# What the verdict is made of, compared as they are (lists and dicts of numbers and names).
COMPARED = ("ranks", "slow_workers", "causes", "collective_arrivals", "abnormal_workers", "busy_ms",
            "bottleneck_ratio_by_category", "python_functions", "communication")


def sets(tmp: Path) -> dict[str, list[Path]]:
    out = {name: sorted((DATA / name).glob("*.json.gz"))
           for name in ("hta_sampled2", "resnet_mi300_pyfn", "hta_nccl_meta_a100")}
    out["slow_rank_of_4"] = slow_rank_set(tmp / "slow4")
    return out


def test_replayed_sets_report_what_analyze_reports(kafka_settings: Settings, tmp_path: Path) -> None:
    with processors(kafka_settings, tmp_path, f"lo{uuid.uuid4().hex[:8]}.") as settings:
        for name, paths in sets(tmp_path).items():
            live = replayed_report(settings, f"lo-{name}", f"rp{uuid.uuid4().hex[:6]}-0", paths)
            offline = offline_report(settings, paths)["diagnosis"]
            for key in COMPARED:
                assert live.get(key) == offline.get(key), (name, key, live.get(key), offline.get(key))
            if name == "slow_rank_of_4":       # the verdict itself, not only its equality
                assert [s["rank"] for s in live["slow_workers"]] == [3]
                assert live["causes"] and {c["rank"] for c in live["causes"]} == {3}
                assert live["collective_arrivals"]["straggler"] == 3
            if name == "hta_sampled2":         # two ranks: no slow worker, but an arrival order
                assert live["collective_arrivals"]["matched_calls"] > 0
