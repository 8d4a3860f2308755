"""The alert JSON Schema (rankscope/alert.schema.json) accepts every alert the rules publish and
refuses a wrong kind, a missing field and another schema_version.

Real alerts come from the pure rule engine, driven as tests/stream_processors/ drives it (their
helpers are reused), and are encoded with ``Alert.to_json``, as the processors publish them.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from rankscope.alert_schema import alert_schema, validate
from rankscope.protocol.alerts import ALERT_KINDS, ALERT_SCHEMA_VERSION, ALERT_STATUSES, MAX_RANKS, Alert
from rankscope.stream_processors.pipeline import TwoStage
from rankscope.stream_processors.report_alerts import ReportAlerts
from tests.fr_dumps import ModelledJob
from tests.stream_processors import test_failures as failures
from tests.stream_processors import test_monitor as monitor
from tests.stream_processors import test_slow_rule as slow_rule
from tests.stream_processors.test_collective_rules import run as run_modelled
from tests.stream_processors.test_report_alerts import report


def hang_alerts() -> list[Alert]:
    mon = TwoStage(job="j")
    monitor.feed_healthy(mon, 100.0, n=30)
    out = mon.scan(100.0, monitor.S)
    for r in range(4):
        frames = monitor.HANG_FRAMES if r == 3 else monitor.WAIT_FRAMES
        mon.apply(monitor.hb(r, 29, 12.0, [{"thread": "MainThread", "frames": frames}]), 112.0, monitor.S)
    out += mon.scan(112.0, monitor.S)
    monitor.feed_healthy(mon, 114.0, first=30, n=5)
    return out + mon.scan(114.0, monitor.S)


def dead_rank_alerts() -> list[Alert]:
    mon = TwoStage(job="j")
    monitor.feed_healthy(mon, 100.0, n=30)
    mon.apply(monitor.env("exit", 0, {"step": 29, "reason": "completed", "detail": ""}), 101.0, monitor.S)
    for t in range(101, 110):
        for r in (1, 2):
            mon.apply(monitor.hb(r, 29, 0.5), float(t), monitor.S)
    return mon.scan(109.0, monitor.S)


def slow_rank_alerts() -> list[Alert]:
    mon = TwoStage(job="j")
    out = []
    for i in range(6):
        monitor.feed_healthy(mon, 100.0 + i, first=i * 10, n=10, slow_rank=2)
        out += mon.scan(100.0 + i, monitor.S)
    for i in range(6, 12):
        monitor.feed_healthy(mon, 100.0 + i, first=i * 10, n=20)
        out += mon.scan(100.0 + i, monitor.S)
    _, modelled, _ = run_modelled(ModelledJob(compute_ns={0: 5_000_000, 1: 5_000_000, 2: 20_000_000, 3: 5_000_000}), 6)
    starved = slow_rule.Job(seed=5)     # a straggler starved of CPU (details.cpu_wait)
    out += starved.run(3000, lambda r, s: slow_rule.BUSY_NS * (3 if r == 1 else 2) // 2,
                       wait_share=lambda r: 0.9 if r == 1 else 0.03)
    assert any(a.details.get("cpu_wait", {}).get("starved") for a in out)
    return out + modelled       # the last judged from collectives (details.process_group, .collective)


def rank_failed_alerts() -> list[Alert]:
    mon = TwoStage(job="j")
    failures.run_job(mon, 100.0)
    mon.apply(failures.exit_exc(2, 39, 100.5, "RuntimeError: CUDA error: an illegal memory access was encountered",
                                "RuntimeError", failures.TRACEBACK), 101.0, failures.S)
    mon.apply(failures.exit_exc(0, 39, 100.6, "DistBackendError: Connection reset by peer"), 101.0, failures.S)
    mon.apply(failures.exit_signal(3, 39, 100.9), 102.0, failures.S)
    out = []
    for t in (102.0, 103.0, 104.0, 105.0, 106.0, 110.0):
        out += mon.scan(t, failures.S)
    return out


def collective_mismatch_alerts() -> list[Alert]:
    _, alerts, _ = run_modelled(ModelledJob(compute_ns={r: 5_000_000 for r in range(4)}, odd_rank=3, odd_step=50), 3)
    return alerts


def abnormal_worker_alerts() -> list[Alert]:
    ra = ReportAlerts()
    return [a for n, slow in enumerate(([1], [1, 2], [])) for a in ra.on_report(report(f"w{n}", slow), n + 1)]


SCENARIOS = {"hang": hang_alerts, "dead_rank": dead_rank_alerts, "slow_rank": slow_rank_alerts,
             "rank_failed": rank_failed_alerts, "collective_mismatch": collective_mismatch_alerts,
             "abnormal_worker": abnormal_worker_alerts}


def published(alert: Alert) -> dict[str, Any]:
    """The alert as a consumer of the alerts topic decodes it."""
    return json.loads(alert.to_json())


def a_hang() -> dict[str, Any]:
    return published(hang_alerts()[0])


def test_the_schema_is_valid_and_names_the_code_s_kinds_and_statuses() -> None:
    schema = alert_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert str(ALERT_SCHEMA_VERSION) in schema["$id"] and f"schema_version {ALERT_SCHEMA_VERSION}" in schema["title"]
    props = schema["properties"]
    assert props["schema_version"] == {**props["schema_version"], "const": ALERT_SCHEMA_VERSION}
    assert set(props["kind"]["enum"]) == ALERT_KINDS == set(SCENARIOS)
    assert set(props["status"]["enum"]) == ALERT_STATUSES
    assert set(schema["required"]) == set(Alert.__dataclass_fields__) == set(props)
    assert props["ranks"]["maxItems"] == MAX_RANKS           # the rules' bound, declared in rankscope/protocol/alerts.py
    from rankscope.stream_processors import profile_digest
    assert schema["$defs"]["slow_rank_details"]["properties"]["profile"]["maxItems"] == profile_digest.NAMED_PATHS


@pytest.mark.parametrize("kind", sorted(SCENARIOS))
def test_every_alert_the_rules_publish_validates(kind: str) -> None:
    alerts = [a for a in SCENARIOS[kind]() if a.kind == kind]
    assert alerts, f"the {kind} scenario raised no {kind} alert"
    for a in alerts:
        validate(published(a))
    if kind in ("hang", "slow_rank", "abnormal_worker"):
        assert "resolved" in {a.status for a in alerts}    # resolved versions are checked too


def test_extra_details_keys_are_allowed() -> None:
    doc = a_hang()
    doc["details"]["something_new"] = {"any": ["shape"]}
    checker = jsonschema.Draft202012Validator(alert_schema())
    assert [e.message for e in checker.iter_errors(doc)] == []
    doc["something_new"] = 1           # the same key at the top level is refused
    assert [list(e.path) or e.validator for e in checker.iter_errors(doc)] == ["additionalProperties"]


@pytest.mark.parametrize("change, field", [
    ({"kind": "stall"}, "kind"),
    ({"schema_version": 2}, "schema_version"),
    ({"status": "closed"}, "status"),
    ({"severity": "info"}, "severity"),
    ({"ranks": ["3"]}, "ranks"),
    ({"unknown_field": 1}, "unknown_field"),
])
def test_a_wrong_value_is_refused(change: dict[str, Any], field: str) -> None:
    doc = {**a_hang(), **change}
    with pytest.raises(jsonschema.ValidationError) as e:
        validate(doc)
    assert field in str(e.value)


@pytest.mark.parametrize("field", ["summary", "alert_id", "schema_version", "stack_groups"])
def test_a_missing_field_is_refused(field: str) -> None:
    doc = a_hang()
    del doc[field]
    with pytest.raises(jsonschema.ValidationError, match=field):
        validate(doc)


def test_documented_details_of_a_kind_are_checked() -> None:
    doc = a_hang()
    doc["details"]["stalled_ranks"] = "0,1,2"
    with pytest.raises(jsonschema.ValidationError, match="stalled_ranks"):
        validate(doc)
    del doc["details"]["stalled_ranks"]
    with pytest.raises(jsonschema.ValidationError, match="stalled_ranks"):
        validate(doc)
