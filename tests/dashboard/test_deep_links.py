"""Deep links on a fresh server: the first request a Streamlit server ever gets is a page URL.

Each case starts its own server (the store is filled once by a subprocess; chDB lets one process
open it, so the servers run one after another), opens the page URL first in headless Chromium, and
expects the app's own navigation (every page title of dashboard/app.py in the sidebar) with the
page's own content, never Streamlit's "Page not found" or a list of file names. The page finds the
server at the app's base URL on its first try (dashboard/base_url_hint.py): no health check of the
page's own path, which answers 404.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sample_data as sd
from browser import launch_browser, wait_for_text
from served import ROOT, free_port, served, streamlit_cmd

pytestmark = pytest.mark.browser

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
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "RANKSCOPE_CLICKHOUSE_DSN": filled_dsn, "RANKSCOPE_DATA_DIR": str(tmp_path),
           "RANKSCOPE_DEAD_AFTER_S": "3600"}
    with served(streamlit_cmd(port), port, env, tmp_path / "streamlit.log") as url:
        yield url


def sidebar_links(page) -> list[str]:
    nav = page.locator("[data-testid='stSidebarNav']")
    nav.wait_for(state="visible", timeout=180_000)
    return [t.split("\n")[-1].strip() for t in nav.get_by_role("link").all_inner_texts()]  # after the icon


@pytest.mark.parametrize("path", list(DEEP_LINKS))
def test_a_page_url_opened_first_shows_the_apps_navigation(fresh_server: str, path: str):
    title, content = DEEP_LINKS[path]
    with launch_browser() as page:
        health: list[tuple[str, int]] = []
        page.on("response", lambda r: health.append((r.url, r.status)) if "/_stcore/health" in r.url else None)
        page.goto(fresh_server + path)
        wait_for_text(page, content, 180)
        assert health and all(url == fresh_server + "/_stcore/health" and status == 200 for url, status in health), health
        main = page.locator("[data-testid='stMain']")
        assert main.get_by_role("heading", name=title).first.is_visible()
        links = sidebar_links(page)
        assert links == NAV_TITLES, f"sidebar of {path}: {links}"
        assert not page.get_by_text(re.compile("page not found", re.I)).count()
        assert page.url.startswith(fresh_server + path.split("?")[0])
