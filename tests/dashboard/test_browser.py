"""The dashboard in a real browser: a Streamlit server process, headless Chromium, screenshots.

chDB lets one process open a data directory, so a subprocess fills the store and exits before the
server opens it. Screenshots land in tests/artifacts/. Fails (never skips) without Chromium.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sample_data as sd
from browser import launch_browser, screenshot, wait_for_charts, wait_for_text
from served import ROOT, free_port, served, streamlit_cmd

pytestmark = pytest.mark.browser

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("browser")
    dsn = f"chdb://{tmp / 'clickhouse'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(Path(sd.__file__)), dsn], env=env, cwd=ROOT, check=True,
                   timeout=120, capture_output=True)
    port = free_port()
    env.update({"RANKSCOPE_CLICKHOUSE_DSN": dsn, "RANKSCOPE_DATA_DIR": str(tmp),
                # The sample ranks stop heartbeating once written; keep them alive for the test.
                "RANKSCOPE_DEAD_AFTER_S": "3600"})
    t0 = time.monotonic()
    with served(streamlit_cmd(port), port, env, tmp / "streamlit.log") as url:
        print(f"streamlit healthy after {time.monotonic() - t0:.1f} s")
        yield url


def test_fleet_to_job_to_alerts(server):
    t0 = time.monotonic()
    with launch_browser() as page:
        page.goto(server + "/")
        wait_for_text(page, "Fleet overview", 60)
        link = page.get_by_role("link", name=re.compile(re.escape(sd.HANG_JOB)))
        link.first.wait_for(state="visible", timeout=30_000)
        wait_for_text(page, "Last updated")  # the live panel has rendered (tables are canvas)
        wait_for_text(page, "GPU utilisation")
        assert wait_for_charts(page) >= 1  # the per-GPU heatmap
        print(f"fleet page ready after {time.monotonic() - t0:.1f} s")
        assert page.get_by_role("button", name="Deploy").count() == 0  # no developer toolbar (served.py)
        screenshot(page, "dashboard_fleet")

        link.first.click()
        page.wait_for_url(re.compile(rf"/job\?job={re.escape(sd.HANG_JOB)}"), timeout=30_000)
        wait_for_text(page, sd.HANG_FUNCTION)
        wait_for_text(page, "Slow rank 1")
        table = page.locator("[data-testid='stTable']").first
        table.wait_for(state="visible", timeout=30_000)
        cells = table.inner_text()
        for word in ("slow", "hung", "running", "node-a", "node-b"):
            assert word in cells, f"{word!r} not in ranks table: {cells!r}"
        summary = page.get_by_text(re.compile(r"rank 3 .*slow.*rank 1")).first
        assert summary.is_visible()
        assert wait_for_charts(page) >= 1  # step time per rank
        caption = page.get_by_text(re.compile(r"^Last updated")).first
        first = caption.inner_text()
        # The live fragment reruns by itself (RANKSCOPE_DASHBOARD_REFRESH_S = 2 s after its last run ended);
        # on a full machine the Fleet page took 15 s to show and a Job page run can take as long, so the deadline is generous.
        page.wait_for_function(
            "t => [...document.querySelectorAll('[data-testid=\"stCaptionContainer\"]')]"
            ".some(e => e.innerText.startsWith('Last updated') && e.innerText !== t)", arg=first,
            timeout=60_000)
        print(f"job page ready after {time.monotonic() - t0:.1f} s")
        screenshot(page, "dashboard_job")

        page.get_by_role("link", name="Alerts").first.click()
        wait_for_text(page, "Open incidents")
        wait_for_text(page, sd.HANG_FUNCTION)
        wait_for_text(page, f"Open job {sd.HANG_JOB}")
        print(f"alerts page ready after {time.monotonic() - t0:.1f} s")
        screenshot(page, "dashboard_alerts")


def test_host_traces_reports_sql_pages(server):
    t0 = time.monotonic()
    with launch_browser() as page:
        page.goto(server + "/")
        wait_for_text(page, "Fleet overview", 60)
        wait_for_text(page, "Last updated")
        page.get_by_role("link", name="Host").first.click()   # the sidebar entry
        wait_for_text(page, "GPUs now")
        wait_for_text(page, "NVLink")
        wait_for_text(page, "Disk")
        assert wait_for_charts(page, at_least=12) == 12
        print(f"host page ready after {time.monotonic() - t0:.1f} s")
        screenshot(page, "dashboard_host")

        page.goto(f"{server}/traces?job={sd.HANG_JOB}")
        wait_for_text(page, "Request a trace window", 60)
        wait_for_text(page, "Flame graph (Python call paths)")
        wait_for_text(page, "Chrome / Perfetto trace")
        assert wait_for_charts(page) == 1  # the flame graph
        with page.expect_download(timeout=30_000) as dl:
            page.get_by_role("button", name="Chrome / Perfetto trace").click()
        trace = json.loads(Path(dl.value.path()).read_text())
        assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 96
        print(f"trace windows page ready after {time.monotonic() - t0:.1f} s")
        screenshot(page, "dashboard_traces")

        page.goto(f"{server}/reports")
        wait_for_text(page, "temporal breakdown", 60)
        wait_for_text(page, sd.WINDOW_ID)
        print(f"reports page ready after {time.monotonic() - t0:.1f} s")
        screenshot(page, "dashboard_reports")

        page.goto(f"{server}/sql")
        wait_for_text(page, "SQL console", 60)
        page.get_by_role("button", name="Run").click()
        wait_for_text(page, re.compile(r"\d+ rows? in [\d.]+ s"))
        page.get_by_label("Query").fill("DROP TABLE rankscope.jobs")
        page.get_by_role("button", name="Run").click()
        wait_for_text(page, "DROP is not allowed")
        page.get_by_label("Query").fill(f"SELECT job, rank, host FROM ranks WHERE job = '{sd.HANG_JOB}' ORDER BY rank")
        page.get_by_role("button", name="Run").click()
        wait_for_text(page, "4 rows in")
        print(f"sql page ready after {time.monotonic() - t0:.1f} s")
        screenshot(page, "dashboard_sql")
