"""Deep links on a fresh server: the first request a Streamlit server ever gets is a page URL.

Each case starts its own server (the store is filled once by a subprocess; chDB lets one process
open it, so the servers run one after another), opens the page URL first in headless Chromium, and
expects the app's own navigation (every page title of dashboard/app.py in the sidebar) with the
page's own content, never Streamlit's "Page not found" or a list of file names.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import sample_data as sd
from browser import launch_browser, wait_for_text

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0
NAV_TITLES = ["Fleet overview", "Job", "Alerts", "Host", "Trace windows", "Reports", "SQL console"]
#: url -> (page title, a text only that page's content shows)
DEEP_LINKS = {
    f"/job?job={sd.HANG_JOB}": ("Job", sd.HANG_FUNCTION),
    "/alerts": ("Alerts", "Open incidents"),
    f"/traces?job={sd.HANG_JOB}": ("Trace windows", "Request a trace window"),
    "/reports": ("Reports", sd.WINDOW_ID),
    "/sql": ("SQL console", "Read-only: one"),
    "/host": ("Host", "GPUs now"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def filled_dsn(tmp_path_factory: pytest.TempPathFactory) -> str:
    dsn = f"chdb://{tmp_path_factory.mktemp('deeplinks') / 'clickhouse'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(Path(sd.__file__)), dsn], env=env, cwd=ROOT, check=True,
                   timeout=120, capture_output=True)
    return dsn


@pytest.fixture
def fresh_server(filled_dsn: str, tmp_path: Path):
    """A Streamlit server that has answered no page yet (only its health endpoint)."""
    port = _free_port()
    log = tmp_path / "streamlit.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "RANKSCOPE_CLICKHOUSE_DSN": filled_dsn, "RANKSCOPE_DATA_DIR": str(tmp_path),
           "RANKSCOPE_DEAD_AFTER_S": "3600"}
    cmd = [sys.executable, "-m", "streamlit", "run", "dashboard/app.py", "--server.port", str(port),
           "--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"streamlit exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"streamlit not healthy:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def sidebar_links(page) -> list[str]:
    nav = page.locator("[data-testid='stSidebarNav']")
    nav.wait_for(state="visible", timeout=180_000)
    return [t.split("\n")[-1].strip() for t in nav.get_by_role("link").all_inner_texts()]  # after the icon


@pytest.mark.parametrize("path", list(DEEP_LINKS))
def test_a_page_url_opened_first_shows_the_apps_navigation(fresh_server: str, path: str):
    title, content = DEEP_LINKS[path]
    with launch_browser() as page:
        page.goto(fresh_server + path)
        wait_for_text(page, content, 180)
        main = page.locator("[data-testid='stMain']")
        assert main.get_by_role("heading", name=title).first.is_visible()
        links = sidebar_links(page)
        assert links == NAV_TITLES, f"sidebar of {path}: {links}"
        assert not page.get_by_text(re.compile("page not found", re.I)).count()
        assert page.url.startswith(fresh_server + path.split("?")[0])
