"""docker-compose.yml, its image and its env file, checked statically (no Docker engine here).

The same env file configures the no-Docker run of the topology (tests/integration/test_topology.py).
"""

from __future__ import annotations

import base64
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from rankscope.cli import build_parser
from rankscope.config import Settings
from rankscope.storage.serve import check_bind

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
ENV_FILE = REPO / "deploy" / "rankscope.env"
DOCKERFILE = REPO / "docker" / "server.Dockerfile"
RANKSCOPE_SERVICES = {"topics", "processors", "sink", "dashboard"}
MONITORING = {"prometheus", "grafana"}   # profile `monitoring`
LONG_RUNNING = {"kafka", "clickhouse", "processors", "sink", "dashboard"} | MONITORING
SERVICE_KEYS = {"image", "build", "command", "entrypoint", "environment", "env_file", "restart", "ports",
                "volumes", "depends_on", "healthcheck", "deploy", "ulimits", "stop_grace_period", "profiles"}
RESTART = {"no", "always", "on-failure", "unless-stopped"}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
# ${NAME}, ${NAME:-default}, ${NAME:?message}
INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def read_env_file(path: Path = ENV_FILE) -> dict[str, str]:
    """``KEY=VALUE`` lines of an env file (comments and blank lines skipped), as Docker reads them."""
    out: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"{path.name}:{n}: not KEY=VALUE: {line!r}"
        assert key not in out, f"{path.name}:{n}: {key} set twice"
        out[key] = value
    return out


def interpolate(value: str, shell: dict[str, str]) -> str:
    """Compose's variable interpolation; a required (``:?``) variable missing from ``shell`` fails."""
    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if shell.get(name):
            return shell[name]
        assert op != ":?", f"${{{name}}} is required: {arg}"
        return arg or ""
    return INTERPOLATION.sub(one, value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict) and set(doc) <= {"name", "services", "volumes", "networks", "x-rankscope"}
    return doc


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def service_env(service: dict[str, Any], shell: dict[str, str]) -> dict[str, str]:
    """What a service's process sees: its env files, then its ``environment`` (interpolated)."""
    env: dict[str, str] = {}
    for f in service.get("env_file", []):
        env.update(read_env_file(REPO / f))
    env.update({k: interpolate(str(v), shell) for k, v in (service.get("environment") or {}).items()})
    return env


SHELL = {"CLICKHOUSE_PASSWORD": "ch-secret", "RANKSCOPE_DASHBOARD_PASSWORD": "dash-secret"}


def test_services_and_schema(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == LONG_RUNNING | {"topics"}
    for name, svc in services.items():
        assert set(svc) <= SERVICE_KEYS, f"{name}: unknown keys {set(svc) - SERVICE_KEYS}"
        assert ("image" in svc) or ("build" in svc), name
        assert svc.get("restart") in RESTART, f"{name}: restart policy {svc.get('restart')!r}"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services and dep != name, f"{name} depends on {dep}"
            assert cond["condition"] in CONDITIONS, f"{name}: {cond}"
        for port in svc.get("ports", []):
            assert re.fullmatch(r"(127\.0\.0\.1:)?\d+:\d+", port), f"{name}: port {port!r}"
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if source.startswith("./"):   # a file or folder of this repository, read-only
                assert (REPO / source).exists() and vol.endswith(":ro"), f"{name}: bind mount {vol!r}"
            else:
                assert source in (compose.get("volumes") or {}), f"{name}: volume {source} is not a named volume"
    for name in LONG_RUNNING:
        svc = services[name]
        assert svc["restart"] in ("always", "unless-stopped"), name
        hc = svc.get("healthcheck")
        assert hc and hc["test"][0] in ("CMD", "CMD-SHELL") and len(hc["test"]) > 1, f"{name}: healthcheck"
        assert {"interval", "timeout", "retries"} <= set(hc), f"{name}: healthcheck {hc}"
    # one-shot topic creation: restarted on failure, awaited by every service that needs the topics
    assert services["topics"]["restart"] == "on-failure"
    for name in ("processors", "sink", "dashboard"):
        assert services[name]["depends_on"]["topics"]["condition"] == "service_completed_successfully"
    assert {"kafka-data", "clickhouse-data"} <= set(compose["volumes"])


def test_monitoring_runs_only_under_its_profile(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        assert svc.get("profiles", []) == (["monitoring"] if name in MONITORING else []), f"{name}: profiles"
    for name in MONITORING:
        image = services[name]["image"]
        # name:tag only: no registry host, no digest, no floating tag
        assert re.fullmatch(r"[a-z0-9-]+/[a-z0-9-]+:v?\d+\.\d+\.\d+", image), f"{name}: image {image!r}"
        assert "build" not in services[name]
        for port in services[name]["ports"]:
            assert port.startswith("127.0.0.1:"), f"{name}: {port} is published beyond the host's loopback"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    assert mounts["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus/prometheus.yml"
    grafana = services["grafana"]
    plugins = grafana["environment"]["GF_INSTALL_PLUGINS"].split(",")
    assert [p.split()[0] for p in plugins] == ["grafana-clickhouse-datasource"], plugins
    assert grafana["depends_on"]["clickhouse"]["condition"] == "service_healthy"
    # The datasource reads the dashboard's ClickHouse user and password from Grafana's environment.
    env, dash = service_env(grafana, SHELL), Settings.from_env(service_env(services["dashboard"], SHELL))
    assert env["RANKSCOPE_CLICKHOUSE_USER"] == dash.clickhouse_user
    assert env["RANKSCOPE_CLICKHOUSE_PASSWORD"] == dash.clickhouse_password == SHELL["CLICKHOUSE_PASSWORD"]
    assert "GF_SECURITY_ADMIN_PASSWORD" in env and not env["GF_SECURITY_ADMIN_PASSWORD"]   # no stored secret
    assert service_env(grafana, {**SHELL, "GRAFANA_ADMIN_PASSWORD": "g"})["GF_SECURITY_ADMIN_PASSWORD"] == "g"


def test_kafka_advertises_the_host_from_a_variable(services: dict[str, dict[str, Any]]) -> None:
    raw = services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert "localhost" not in INTERPOLATION.sub("", raw), raw    # only as the variable's default

    def host_listener(shell: dict[str, str]) -> str:
        listeners = dict(u.split("://", 1) for u in interpolate(raw, shell).split(","))
        return listeners["HOST"]

    assert host_listener({}) == "localhost:9092"
    assert host_listener({"KAFKA_ADVERTISED_HOST": "gpu-head.example"}) == "gpu-head.example:9092"
    assert interpolate(raw, {}).split(",")[0] == "PLAINTEXT://kafka:19092"   # the services' listener is fixed


def test_scalable_services_have_no_fixed_host_port(services: dict[str, dict[str, Any]]) -> None:
    for name in ("processors", "sink"):
        assert services[name]["deploy"]["replicas"] >= 1
        assert not services[name].get("ports"), f"{name}: a host port stops --scale"


def test_rankscope_commands_parse_with_the_cli(services: dict[str, dict[str, Any]]) -> None:
    assert re.search(r'^ENTRYPOINT \["rankscope"\]$', DOCKERFILE.read_text(), re.M)
    parser = build_parser()
    seen = set()
    for name in RANKSCOPE_SERVICES:
        svc = services[name]
        assert svc["build"]["dockerfile"] == "docker/server.Dockerfile"
        assert (REPO / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        cmd = svc["command"]
        assert isinstance(cmd, list) and all(isinstance(a, str) for a in cmd), f"{name}: exec form"
        args = parser.parse_args(cmd)
        seen.add(getattr(args.func, "__name__", ""))
    assert {"processors", "cmd_sink", "cmd_serve"} <= seen, seen


def test_kraft_cluster_id_is_a_uuid(services: dict[str, dict[str, Any]]) -> None:
    cid = services["kafka"]["environment"]["CLUSTER_ID"]
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", cid), cid
    assert len(base64.urlsafe_b64decode(cid + "==")) == 16


def test_every_setting_named_exists() -> None:
    known = set(Settings.env_names())
    names = set(read_env_file()) | set(re.findall(r"RANKSCOPE_[A-Z0-9_]+", COMPOSE.read_text()))
    names |= set(re.findall(r"RANKSCOPE_[A-Z0-9_]+", ENV_FILE.read_text()))  # the commented ones too
    assert {"RANKSCOPE_DASHBOARD_HOST", "RANKSCOPE_CLICKHOUSE_PASSWORD"} <= names
    unknown = sorted(names - known)
    assert not unknown, f"not in Settings: {unknown}"


def test_each_service_builds_valid_settings(services: dict[str, dict[str, Any]]) -> None:
    advertised = interpolate(services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"], SHELL)
    for name in RANKSCOPE_SERVICES:
        env = service_env(services[name], SHELL)
        settings = Settings.from_env(env)
        assert settings.bootstrap_servers in {urlsplit(u).netloc for u in advertised.split(",")}
        assert settings.clickhouse_dsn.startswith("http://clickhouse:8123")
        assert settings.clickhouse_password == SHELL["CLICKHOUSE_PASSWORD"]
        health = services[name].get("healthcheck")
        if health:
            port = urlsplit(health["test"][-1]).port
            expected = {"processors": settings.metrics_port_processors, "sink": settings.metrics_port_sink,
                        "dashboard": settings.dashboard_port}[name]
            assert port == expected, f"{name}: healthcheck port {port}, setting {expected}"
    dash = Settings.from_env(service_env(services["dashboard"], SHELL))
    assert dash.dashboard_host == "0.0.0.0" and dash.dashboard_password == SHELL["RANKSCOPE_DASHBOARD_PASSWORD"]
    check_bind(dash)  # serve would start
    ports = services["dashboard"]["ports"]
    assert any(p.endswith(f":{dash.dashboard_port}") for p in ports), ports


def test_secrets_are_required_not_stored(services: dict[str, dict[str, Any]]) -> None:
    env_text = ENV_FILE.read_text()
    assert "PASSWORD=" not in env_text
    with pytest.raises(AssertionError, match="RANKSCOPE_DASHBOARD_PASSWORD"):
        service_env(services["dashboard"], {"CLICKHOUSE_PASSWORD": "x"})
    with pytest.raises(AssertionError, match="CLICKHOUSE_PASSWORD"):
        service_env(services["sink"], {})


def test_server_image_has_no_torch_and_no_test_tools() -> None:
    text = DOCKERFILE.read_text()
    runs = " ".join(line for line in text.splitlines() if line.startswith(("RUN", "    ")))
    assert "[server]" in runs
    for word in ("torch", "pytest", "playwright", "ruff", "mypy", "-e ", "[dev]"):
        assert word not in runs, word
    copied = {shlex.split(line)[1] for line in text.splitlines() if line.startswith("COPY ") and "--from" not in line}
    assert "tests" not in copied and "benchmarks" not in copied
    folders = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    assert folders <= copied, folders - copied        # every folder the wheel is built from
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)
