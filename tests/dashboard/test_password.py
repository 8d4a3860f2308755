"""The dashboard's bind address, password, sign-in cookie and toolbar, through ``rankscope serve``
and a real browser.

The server binds 0.0.0.0 (a non-loopback bind) and the browser connects through 127.0.0.1.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser import launch_browser, screenshot, wait_for_text
from served import ROOT, free_port, served

from rankscope.config import ConfigError, Settings
from rankscope.dashboard.login import password_ok
from rankscope.dashboard.session_cookie import KEY_FILE, cookie_name
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
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("password")


@pytest.fixture(scope="module")
def protected(data_dir: Path) -> Iterator[str]:
    tmp = data_dir
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
        wait_for_text(page, "Last updated", 60)  # the page has run; the toolbar came with the session
        # `rankscope serve` hides Streamlit's developer toolbar and menu (shown on localhost by default)
        assert page.get_by_role("button", name="Deploy").count() == 0
        assert page.locator("[data-testid='stMainMenu']").count() == 0

    with launch_browser() as page:  # a new browser session starts signed out
        page.goto(protected + "/")
        wait_for_text(page, "Password", 60)
        assert page.get_by_role("link", name="SQL console").count() == 0


def _sign_in(page: Any, url: str) -> None:
    page.goto(url)
    page.get_by_label("Password", exact=True).fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    _wait_signed_in(page)


def _wait_signed_in(page: Any) -> None:
    page.get_by_role("button", name="Sign out").wait_for(state="visible", timeout=60_000)
    assert page.get_by_label("Password", exact=True).count() == 0


def _wait_cookie(page: Any, name: str, present: bool) -> None:
    page.wait_for_function(
        "([n, p]) => document.cookie.split('; ').some(c => c.startsWith(n + '=')) === p",
        arg=[name, present], timeout=30_000)


@pytest.mark.browser
def test_sign_in_lasts_across_reloads_and_tabs(protected: str, data_dir: Path) -> None:
    name = cookie_name(int(protected.rsplit(":", 1)[1]))
    with launch_browser() as page:
        t0 = time.time()
        _sign_in(page, protected + "/")
        _wait_cookie(page, name, True)
        (cookie,) = [c for c in page.context.cookies() if c["name"] == name]
        assert re.fullmatch(r"[0-9]+\.[0-9a-f]{64}", cookie["value"]), cookie
        assert cookie["sameSite"] == "Strict" and cookie["path"] == "/" and not cookie["secure"]
        assert abs(cookie["expires"] - (t0 + 12 * 3600)) < 120, cookie  # dashboard_session_h default
        key = data_dir / KEY_FILE
        assert stat.S_IMODE(key.stat().st_mode) == 0o600

        page.reload()  # a new Streamlit session of the same browser: the cookie signs it in
        _wait_signed_in(page)
        wait_for_text(page, "Fleet overview", 60)

        tab = page.context.new_page()  # a new tab of the same browser
        tab.goto(protected + "/sql")
        _wait_signed_in(tab)
        wait_for_text(tab, "SQL console", 60)

        other = page.context.browser.new_context()  # another browser profile: no cookie
        try:
            stranger = other.new_page()
            stranger.goto(protected + "/")
            wait_for_text(stranger, "Password", 60)
            assert stranger.get_by_role("link", name="SQL console").count() == 0
            # a forged cookie (a wrong MAC) is refused
            forged = f"{int(time.time()) + 3600}.{'0' * 64}"
            other.add_cookies([{"name": name, "value": forged, "url": protected}])
            stranger.reload()
            wait_for_text(stranger, "Password", 60)
            assert stranger.get_by_role("link", name="SQL console").count() == 0
            # the real cookie, copied, signs in (it is a bearer token until it expires)
            other.add_cookies([{"name": name, "value": cookie["value"], "url": protected}])
            stranger.reload()
            _wait_signed_in(stranger)
        finally:
            other.close()

        tab.get_by_role("button", name="Sign out").click()  # deletes the cookie and reloads the tab
        _wait_cookie(tab, name, False)
        wait_for_text(tab, "Password", 60)
        assert tab.get_by_role("link", name="SQL console").count() == 0
        page.reload()
        wait_for_text(page, "Password", 60)
        assert page.get_by_role("link", name="SQL console").count() == 0
