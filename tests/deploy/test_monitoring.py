"""deploy/prometheus and deploy/grafana, and how docker-compose.yml's `monitoring` profile mounts them.

Static checks (no Prometheus or Grafana here): every file parses; the Prometheus configuration
scrapes every rankscope service on its settings' port and loads rule files that exist; every rule
is complete and names only metrics that rankscope/metrics.py declares; the provisioning files and
the dashboards have what Grafana reads. Every ClickHouse panel's SQL, its macros expanded as the
plugin expands them, is checked to return rows from a chDB store filled by a real torchrun job
through the real broker, processors and sink (:func:`assert_every_panel_query_returns_rows`, run by
tests/integration/test_end_to_end.py on its slow-and-hanging job).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from rankscope.config import Settings
from rankscope.metrics import Metrics
from rankscope.protocol.alerts import ALERT_KINDS
from tests.integration.helpers import wait_until
from tests.rankscope.test_compose import SHELL, interpolate, service_env

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
# scrape job -> (compose service, the Settings field of its /metrics port)
SCRAPED = {"processors": ("processors", "metrics_port_processors"), "sink": ("sink", "metrics_port_sink"),
           "dashboard": ("dashboard", "metrics_port_serve")}
SEVERITIES = {"critical", "warning", "info"}
DURATION = re.compile(r"(\d+[smhd])+")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def mounts(service: str) -> dict[str, str]:
    """Container path -> repository path (``./...``) of a compose service's bind mounts."""
    out = {}
    for vol in SERVICES[service].get("volumes", []):
        source, target = vol.split(":")[:2]
        if source.startswith("./"):
            out[target] = source
    return out


def dashboards() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, json.loads(p.read_text())) for p in DASHBOARDS]


def panels(kind: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(file, panel title, target) of every target whose datasource is of ``kind``."""
    return [(name, p["title"], t) for name, d in dashboards() for p in d["panels"] for t in p["targets"]
            if t["datasource"]["type"] == kind]


# PromQL ----------------------------------------------------------------------------------------------

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions, keywords,
    label names (inside ``{...}`` or a ``by (...)`` clause), strings or range durations."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)                        # string literals
    e = re.sub(r"\{[^}]*\}", "", e)                                      # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                                     # ranges, subqueries
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group().lower() in PROMQL_WORDS:
            continue
        names.add(m.group())
    return names


def declared_metrics() -> set[str]:
    """Every series name a rankscope process exposes (rankscope/metrics.py's registry)."""
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created"), "info": ("_info",)}
    return {f.name + s for f in Metrics().registry.collect() for s in suffixes[f.type]}


def test_metric_names_parse() -> None:
    assert metric_names('sum by (job, topic) (rate(rankscope_dead_letters_total{stage="x"}[5m])) > 0') \
        == {"rankscope_dead_letters_total"}
    assert metric_names('absent(up{job="sink"}) or histogram_quantile(0.9, sum by (le) (rate(a_bucket[$__rate_interval])))') \
        == {"up", "a_bucket"}
    declared = declared_metrics()
    assert {"rankscope_consumer_lag_seconds", "rankscope_dead_letters_total", "rankscope_open_incidents",
            "rankscope_insert_duration_seconds_bucket"} <= declared
    assert "rankscope_dead_letters" not in declared   # a counter is exposed with _total


# Files --------------------------------------------------------------------------------------------------

def test_every_yaml_and_json_file_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yml")) + sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 5, files
    for f in files:
        assert isinstance(load_yaml(f), dict), f
    assert len(DASHBOARDS) >= 4
    for f in DASHBOARDS:
        assert isinstance(json.loads(f.read_text()), dict), f


def test_prometheus_scrapes_every_service_on_its_settings_port() -> None:
    config = load_yaml(PROMETHEUS)
    assert config["rule_files"], "no rule files"
    for rf in config["rule_files"]:
        assert (PROMETHEUS.parent / rf).is_file(), rf
        # mounted beside the configuration, where Prometheus resolves the relative name
        assert mounts("prometheus")[f"/etc/prometheus/{rf}"] == f"./{(PROMETHEUS.parent / rf).relative_to(REPO)}"
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(SCRAPED) <= set(jobs)
    for job, (service, port_field) in SCRAPED.items():
        port = getattr(Settings.from_env(service_env(SERVICES[service], SHELL)), port_field)
        sc = jobs[job]
        targets = [t for s in sc.get("static_configs", []) for t in s["targets"]]
        targets += [f"{n}:{d['port']}" for d in sc.get("dns_sd_configs", []) for n in d["names"]]
        assert targets == [f"{service}:{port}"], f"{job}: {targets}, expected {service}:{port}"
        # the service listens beyond its loopback, so Prometheus can reach it over the compose network
        assert Settings.from_env(service_env(SERVICES[service], SHELL)).metrics_host == "0.0.0.0"
    for service, _ in SCRAPED.values():
        assert service in SERVICES


def test_alert_rules_are_complete_and_use_declared_metrics() -> None:
    declared = declared_metrics() | {"up"}
    config = load_yaml(PROMETHEUS)
    rules = [r for rf in config["rule_files"] for g in load_yaml(PROMETHEUS.parent / rf)["groups"] for r in g["rules"]]
    assert len(rules) >= 4
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), names
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r["alert"]
        assert isinstance(r["expr"], str) and r["expr"].strip(), r["alert"]
        assert DURATION.fullmatch(r["for"]), f"{r['alert']}: for {r['for']!r}"
        assert r["labels"]["severity"] in SEVERITIES, r["alert"]
        assert r["annotations"]["summary"].strip(), r["alert"]
        unknown = metric_names(r["expr"]) - declared
        assert not unknown, f"{r['alert']}: not declared in rankscope/metrics.py: {unknown}"
    exprs = " ".join(r["expr"] for r in rules)
    for name in ("up", "rankscope_consumer_lag_seconds", "rankscope_dead_letters_total", "rankscope_open_incidents"):
        assert name in metric_names(exprs), name
    # The incident rules split the alert kinds between them: each kind alerts exactly once.
    kinds = [k for r in rules for m in re.finditer(r'kind=~"([^"]+)"', r["expr"]) for k in m.group(1).split("|")]
    assert sorted(kinds) == sorted(ALERT_KINDS), kinds


def test_rule_unit_tests_cover_the_rules() -> None:
    # deploy/prometheus/rankscope.rules.test.yml is for `promtool test rules` (promtool is not a
    # dependency of the project): it loads the rules file and tests alerts that exist.
    doc = load_yaml(PROMETHEUS.parent / "rankscope.rules.test.yml")
    assert doc["rule_files"] == load_yaml(PROMETHEUS)["rule_files"]
    rules = {r["alert"] for rf in doc["rule_files"] for g in load_yaml(PROMETHEUS.parent / rf)["groups"]
             for r in g["rules"]}
    tested = {a["alertname"] for t in doc["tests"] for a in t["alert_rule_test"]}
    assert tested <= rules, tested - rules
    assert {"RankscopeServiceDown", "RankscopeConsumerLagHigh", "RankscopeDeadLetters",
            "RankscopeIncidentCritical"} <= tested


def test_grafana_provisioning() -> None:
    env = service_env(SERVICES["grafana"], SHELL)
    assert mounts("grafana")["/etc/grafana/provisioning"] == f"./{PROVISIONING.relative_to(REPO)}"
    sources: dict[str, dict[str, Any]] = {}
    for f in sorted((PROVISIONING / "datasources").iterdir()):
        doc = load_yaml(f)
        assert doc["apiVersion"] == 1 and set(doc) <= {"apiVersion", "datasources", "deleteDatasources"}, f
        for ds in doc["datasources"]:
            assert {"name", "type", "uid", "access"} <= set(ds), f
            sources[ds["uid"]] = ds
    types = {ds["type"]: ds for ds in sources.values()}
    assert set(types) == {"grafana-clickhouse-datasource", "prometheus"}
    assert sum(bool(ds.get("isDefault")) for ds in sources.values()) <= 1

    ch = types["grafana-clickhouse-datasource"]
    jd = ch["jsonData"]
    dash = Settings.from_env(service_env(SERVICES["dashboard"], SHELL))
    # the same server, port and protocol as the dashboard's DSN (http://clickhouse:8123)
    assert f"{jd['protocol']}://{jd['host']}:{jd['port']}" == dash.clickhouse_dsn and jd["host"] in SERVICES
    assert jd["defaultDatabase"] == "rankscope"
    # Grafana expands ${VAR} from its environment: the dashboard's user and password.
    assert interpolate(jd["username"], env) == dash.clickhouse_user
    assert interpolate(ch["secureJsonData"]["password"], env) == dash.clickhouse_password
    assert "password" not in jd

    prom = types["prometheus"]
    host, port = re.fullmatch(r"http://([a-z-]+):(\d+)", prom["url"]).groups()
    assert host == "prometheus" and any(p.endswith(f":{port}") for p in SERVICES["prometheus"]["ports"])

    doc = load_yaml(PROVISIONING / "dashboards" / "rankscope.yaml")
    assert doc["apiVersion"] == 1 and set(doc) == {"apiVersion", "providers"}
    (provider,) = doc["providers"]
    assert {"name", "type", "options"} <= set(provider) and provider["type"] == "file"
    assert mounts("grafana")[provider["options"]["path"]] == f"./{DASHBOARDS[0].parent.relative_to(REPO)}"


def test_dashboards_have_what_grafana_reads() -> None:
    uids = {ds["uid"]: ds["type"] for f in (PROVISIONING / "datasources").iterdir()
            for ds in load_yaml(f)["datasources"]}
    seen_uids = set()
    for name, d in dashboards():
        assert isinstance(d["title"], str) and d["title"], name
        assert re.fullmatch(r"[a-z0-9-]{1,40}", d["uid"]) and d["uid"] not in seen_uids, name
        seen_uids.add(d["uid"])
        assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36, name
        assert d.get("id") is None, f"{name}: a provisioned dashboard has no fixed id"
        ids = [p["id"] for p in d["panels"]]
        assert d["panels"] and len(ids) == len(set(ids)), name
        for p in d["panels"]:
            where = f"{name}: panel {p.get('id')}"
            assert isinstance(p["id"], int) and isinstance(p["type"], str) and p["title"], where
            g = p["gridPos"]
            assert all(isinstance(g[k], int) for k in "hwxy") and g["x"] + g["w"] <= 24 and g["h"] > 0, where
            assert p["targets"], where
            for t in p["targets"]:
                assert t["refId"] and uids.get(t["datasource"]["uid"]) == t["datasource"]["type"], where
                if t["datasource"]["type"] == "grafana-clickhouse-datasource":
                    assert t["editorType"] == "sql" and t["rawSql"].strip(), where
                    # sqlds formats: 0 = time series (long frames are made wide by a string column), 1 = table
                    assert (t["format"], t["queryType"]) in {(0, "timeseries"), (1, "table")}, where
                    assert p["type"] != "timeseries" or t["format"] == 0, where
                else:
                    assert t["expr"].strip(), where


def test_prometheus_panels_use_declared_metrics() -> None:
    declared = declared_metrics() | {"up"}
    targets = panels("prometheus")
    assert targets
    for name, title, t in targets:
        assert metric_names(t["expr"]) and not metric_names(t["expr"]) - declared, f"{name}: {title}: {t['expr']}"


# The panels' SQL against a real job ------------------------------------------------------------------------

def expand_macros(sql: str, from_ms: int, to_ms: int, interval_s: int) -> str:
    """The query as grafana-clickhouse-datasource sends it: its macros replaced with the text its
    pkg/macros/macros.go makes (time range in Unix ms/s, interval >= 1 s). A macro this does not
    know fails the test, so a dashboard cannot use one that goes untested."""
    interval_s = max(1, int(interval_s))

    def one(m: re.Match[str]) -> str:
        name, arg = m.group(1), m.group(2)
        table: dict[str, Callable[[], str]] = {
            "fromTime": lambda: f"toDateTime({from_ms // 1000})",
            "toTime": lambda: f"toDateTime({to_ms // 1000})",
            "fromTime_ms": lambda: f"fromUnixTimestamp64Milli({from_ms})",
            "toTime_ms": lambda: f"fromUnixTimestamp64Milli({to_ms})",
            "timeFilter": lambda: f"{arg} >= toDateTime({from_ms // 1000}) AND {arg} <= toDateTime({to_ms // 1000})",
            "timeFilter_ms": lambda: (f"{arg} >= fromUnixTimestamp64Milli({from_ms}) AND "
                                      f"{arg} <= fromUnixTimestamp64Milli({to_ms})"),
            "timeInterval": lambda: f"toStartOfInterval(toDateTime({arg}), INTERVAL {interval_s} second)",
            "interval_s": lambda: str(interval_s),
        }
        if name not in table:
            raise AssertionError(f"macro $__{name} is not handled by this test")
        return table[name]()

    out = re.sub(r"\$__(\w+)(?:\(([^()]*)\))?", one, sql)
    assert "$" not in out, f"unexpanded variable in {out}"
    return out


def test_expand_macros_as_the_plugin_does() -> None:
    sql = "SELECT $__timeInterval(ts) AS t WHERE $__timeFilter(ts) AND x >= $__fromTime_ms AND y < $__toTime"
    assert expand_macros(sql, 1_700_000_000_123, 1_700_003_600_456, 0) == (
        "SELECT toStartOfInterval(toDateTime(ts), INTERVAL 1 second) AS t WHERE ts >= toDateTime(1700000000) "
        "AND ts <= toDateTime(1700003600) AND x >= fromUnixTimestamp64Milli(1700000000123) AND y < toDateTime(1700003600)")
    with pytest.raises(AssertionError, match="conditionalAll"):
        expand_macros("SELECT $__conditionalAll(1, $v)", 0, 1, 1)


GPU_HOST = "gpu-node-0"


def send_gpu_samples(settings: Settings, job: str) -> None:
    """One ``hw`` message of rank 0 with GPU rows (devices 0 and 1), through the broker to the sink.

    This CPU machine has no GPU: the job's ranks send host rows only (device -1), so the fleet
    panels' GPU rows (device >= 0, metrics gpu_util and gpm_sm_active_pct) come from this message,
    shaped as a rank's sampler shapes it and stored by the sink's normal insert path."""
    from confluent_kafka import Producer

    from rankscope.protocol.envelope import Envelope, encode, rank_key
    from rankscope.topics import Topic

    now = time.time_ns()
    ts = [now - i * 5 * 10**9 for i in range(6) for _ in (0, 1)]
    devices = [d for _ in range(6) for d in (0, 1)]
    body = {"ts_ns": ts, "device": devices,
            "metrics": {"gpu_util": [90.0 + d for d in devices], "gpm_sm_active_pct": [70.0 + d for d in devices]}}
    env = Envelope(kind="hw", job=job, rank=0, host=GPU_HOST, pid=1, seq=1, sent_ns=now, body=body)
    producer = Producer({"bootstrap.servers": settings.bootstrap})
    producer.produce(Topic.HW.name_for(settings), key=rank_key(job, 0), value=encode(env))
    assert producer.flush(30) == 0


def stored_incidents(store: Any, job: str) -> dict[str, tuple[str, float]] | None:
    """The newest status and lost rank-seconds of each alert kind of ``job`` in the store, once what
    the panels show is there: an open hang, a slow_rank alert that counted lost rank-seconds, and
    :func:`send_gpu_samples`' rows; else None."""
    rows = store.query_rows(
        "SELECT kind, status, lost_rank_seconds FROM (SELECT * FROM rankscope.alerts "
        "WHERE job = {job:String} ORDER BY version DESC LIMIT 1 BY alert_id)", parameters={"job": job})
    got = {str(k): (str(s), float(lost)) for k, s, lost in rows}
    hang_open = got.get("hang", ("resolved", 0))[0] != "resolved"
    gpu = store.query_rows("SELECT count() FROM rankscope.hw_samples WHERE device >= 0")[0][0]
    return got if hang_open and got.get("slow_rank", ("", 0.0))[1] > 0 and gpu else None


def assert_every_panel_query_returns_rows(store: Any, job: str) -> None:
    """Every ClickHouse panel's SQL, its macros expanded for the last hour, returns rows from a store
    that holds only ``job``: a real torchrun job with a slow rank (a slow_rank alert with lost
    rank-seconds) and a hung rank (an open hang), and :func:`send_gpu_samples`' GPU rows.
    tests/integration/test_end_to_end.py runs that job through the real broker, processors and sink."""
    wait_until(lambda: stored_incidents(store, job), 120,
               "an open hang, a slow_rank alert with lost rank-seconds and the GPU samples in the store")
    # Grafana's time range: the last hour up to now; the interval it would pick for it.
    to_ms = time.time_ns() // 10**6
    targets = panels("grafana-clickhouse-datasource")
    results = {title: (target, store.query_df(expand_macros(target["rawSql"], to_ms - 3600 * 1000, to_ms, 5)))
               for _, title, target in targets}
    assert len(results) == len(targets) >= 7, sorted(results)   # titles are unique: one result per panel
    for title, (target, df) in results.items():
        assert len(df) > 0, f"{title}: no rows"
        if target["format"] == 0:   # a time series: a time column first, then labels and values
            assert df.columns[0] == "time" and str(df["time"].dtype).startswith("datetime64"), (title, df.dtypes)
    # Every row comes from this job's store: its steps, its alerts, the GPU host of the hw message.
    assert set(results["Median step time by job"][1]["job"]) == {job}
    assert set(results["p95 step time by job"][1]["job"]) == {job}
    for title in ("GPU utilisation by host", "SM activity by host", "Hosts over the time range"):
        assert set(results[title][1]["host"]) == {GPU_HOST}, title
    assert set(results["Hosts over the time range"][1]["gpus"]) == {2}
    open_now = results["Open incidents"][1]
    assert "hang" in set(open_now["kind"]) and set(open_now["job"]) == {job}
    assert "3" in open_now.loc[open_now["kind"] == "hang", "ranks"].iloc[0].split(",")
    by_kind = dict(zip(results["Open incidents by kind"][1]["kind"], results["Open incidents by kind"][1]["open"],
                       strict=True))
    assert by_kind.get("hang") == 1
    lost = {(r.job, r.kind): r.lost_rank_seconds for r in results["Lost rank-seconds by job and kind"][1].itertuples()}
    assert lost.get((job, "slow_rank"), 0) > 0, lost      # the processors' own estimate
    assert lost.get((job, "hang"), 0) > 0, lost           # world size x the hang's duration so far
