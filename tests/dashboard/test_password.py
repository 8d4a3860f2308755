"""The dashboard's bind address and password, through ``rankscope serve`` and a real browser.

The server binds 0.0.0.0 (a non-loopback bind) and the browser connects through 127.0.0.1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import launch_browser, screenshot, wait_for_text
from served import ROOT, free_port, served

from rankscope.config import ConfigError, Settings
from rankscope.dashboard.login import password_ok
from rankscope.storage.serve import check_bind, streamlit_options

PASSWORD = "correct horse battery staple"


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env.update({"RANKSCOPE_DATA_DIR": str(tmp), "RANKSCOPE_CLICKHOUSE_DSN": f"chdb://{tmp / 'clickhouse'}",
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                "PYTHONUNBUFFERED": "1", **extra})
    return env


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_binds_need_no_password(host: str) -> None:
    settings = Settings(dashboard_host=host)
    check_bind(settings)
    assert streamlit_options(settings)["server_address"] == host
    assert streamlit_options(settings).get("server_enableAgentApi") is True


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_other_binds_need_a_password(host: str) -> None:
    with pytest.raises(ConfigError, match="RANKSCOPE_DASHBOARD_PASSWORD"):
        check_bind(Settings(dashboard_host=host))
    settings = Settings(dashboard_host=host, dashboard_password="pw")
    check_bind(settings)
    assert streamlit_options(settings).get("server_enableAgentApi") is False
    assert "pw" not in repr(settings)


def test_password_comparison() -> None:
    assert password_ok("pässword", "pässword")
    assert not password_ok("password", "pässword") and not password_ok("", "x")


def test_non_loopback_bind_without_password_refuses_to_start(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "rankscope", "serve", "--no-sink"], cwd=tmp_path,
                         env=_env(tmp_path, RANKSCOPE_DASHBOARD_HOST="0.0.0.0",
                                  RANKSCOPE_DASHBOARD_PORT=str(free_port())),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "RANKSCOPE_DASHBOARD_PASSWORD" in res.stderr and "0.0.0.0" in res.stderr, res.stderr
    assert not (tmp_path / "clickhouse").exists()  # refused before opening the store


@pytest.fixture(scope="module")
def protected(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("password")
    port = free_port()
    log = tmp / "serve.log"
    env = _env(tmp, RANKSCOPE_DASHBOARD_HOST="0.0.0.0", RANKSCOPE_DASHBOARD_PORT=str(port),
               RANKSCOPE_DASHBOARD_PASSWORD=PASSWORD)
    with served([sys.executable, "-m", "rankscope", "serve", "--no-sink"], port, env, log, cwd=tmp,
                stop_timeout_s=30) as url:
        yield url
    text = log.read_text()
    assert PASSWORD not in text  # the password never reaches the log
    assert "0.0.0.0" in text and "password required" in text, text[-3000:]


@pytest.mark.browser
def test_password_gate_in_browser(protected: str) -> None:
    with launch_browser() as page:
        page.goto(protected + "/job?job=anything")  # a deep link is gated too
        wait_for_text(page, "Password", 60)
        assert page.get_by_text("Fleet overview").count() == 0
        assert page.get_by_role("link", name="SQL console").count() == 0  # no navigation before sign-in
        screenshot(page, "dashboard_password")

        field = page.get_by_label("Password", exact=True)
        field.fill("wrong password")
        page.get_by_role("button", name="Sign in").click()
        wait_for_text(page, "Wrong password.")
        assert page.get_by_role("link", name="SQL console").count() == 0

        field.fill(PASSWORD)
        page.get_by_role("button", name="Sign in").click()
        page.get_by_role("link", name="SQL console").first.wait_for(state="visible", timeout=60_000)
        page.get_by_role("link", name="Fleet overview").first.click()
        wait_for_text(page, "Fleet overview", 60)

    with launch_browser() as page:  # a new browser session starts signed out
        page.goto(protected + "/")
        wait_for_text(page, "Password", 60)
        assert page.get_by_role("link", name="SQL console").count() == 0
