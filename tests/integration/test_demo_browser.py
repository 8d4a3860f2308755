"""`rankscope demo` as a user runs it, checked in headless Chromium: the slow rank and the hang show up.

The demo's own processes (processors, serve = sink + dashboard, the torchrun job) run detached,
exactly as `make demo` starts them; only the broker is the test session's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urljoin

import pytest

from rankscope.config import Settings
from tests.dashboard.browser import launch_browser, screenshot, wait_for_text
from tests.integration.helpers import child_env, free_port, tail

pytestmark = [pytest.mark.kafka, pytest.mark.torchrun, pytest.mark.browser]


def test_demo_shows_slow_rank_and_hang(kafka_settings: Settings, tmp_path: Path) -> None:
    settings = kafka_settings.with_overrides(
        bootstrap_servers=kafka_settings.bootstrap, topic_prefix=f"d{uuid.uuid4().hex[:6]}.",
        data_dir=str(tmp_path / "demo"), dashboard_port=free_port(), clickhouse_dsn="")
    env = child_env(settings)
    job = f"demo-{uuid.uuid4().hex[:6]}"
    # The hang is planted once the checks of the slow rank are done (`touch` of the file the demo's
    # --hang-when-file names), as a user would: a fixed time in would be too soon on a slow draw (the
    # trace window requested of the running job must start before the hang: a window requested of a
    # hung job never ends) and idle compute on a fast one.
    hang_file = tmp_path / "plant-the-hang"
    cmd = [sys.executable, "-m", "rankscope", "demo", "--job", job, "--hang-when-file", str(hang_file)]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"http://127.0.0.1:{settings.dashboard_port}" in out.stdout
        assert f"rank 3 hangs once {hang_file} exists" in out.stdout, out.stdout
        logs = Path(settings.data_dir) / "logs"
        base = f"http://127.0.0.1:{settings.dashboard_port}"
        with launch_browser() as page:
            page.goto(f"{base}/")
            try:
                link = page.get_by_role("link", name=re.compile(re.escape(job)))
                link.first.wait_for(state="visible", timeout=180_000)
                seen = time.monotonic()       # the job's first messages are stored
                screenshot(page, "demo_fleet")
                differential_shows_the_slow_ranks_function(page, base, job, seen)
                request_id = request_window(page, base, job)
                page.goto(f"{base}/")
                link.first.wait_for(state="visible", timeout=60_000)
                link.first.click()
                page.wait_for_url(re.compile(rf"/job\?job={re.escape(job)}"), timeout=60_000)
                wait_for_text(page, "Slow rank 1", 240)
                screenshot(page, "demo_job_slow")
                the_alert_says_where_its_time_goes(page)
                find_report(page, base, job, request_id)
                hang_file.touch()
                page.goto(f"{base}/job?job={job}")
                wait_for_text(page, "hang_forever", 240)
                page.wait_for_function(  # the ranks table shows both states
                    "() => [...document.querySelectorAll(\"[data-testid='stTable']\")]"
                    ".some(t => t.innerText.includes('hung') && t.innerText.includes('slow'))",
                    timeout=120_000)
            except Exception as e:
                screenshot(page, "demo_failure")
                raise AssertionError(f"{e}\n--- demo-job log\n{tail(logs / 'demo-job.log')}\n--- processors log\n"
                                     f"{tail(logs / 'processors.log')}\n--- serve log\n{tail(logs / 'serve.log')}") from None
            screenshot(page, "demo_job")
    finally:
        subprocess.run([sys.executable, "-m", "rankscope", "down"], env=env, timeout=120)


MOST_ADDED = re.compile(r"^Most added: \S*train.py:\d+ slow_extra_compute,")


def differential_shows_the_slow_ranks_function(page, base: str, job: str, seen: float) -> None:
    """Rank 1's profile against its peers, on the Job page as a user opens it (rank 1 picked), shows
    the function only the slow rank runs on top, from the sampled stacks alone: reloaded until it
    does, and timed from when the job first showed on the Fleet page."""
    deadline = time.monotonic() + 180
    while True:
        page.goto(f"{base}/job?job={job}&profile_rank=1")
        try:
            # The profile panel comes last on the page: on a slow draw a load took more than 5 s, and
            # a shorter wait reloaded the page before the panel ever showed.
            wait_for_text(page, MOST_ADDED, 20)
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
    print(f"rank 1's differential shows slow_extra_compute on top {time.monotonic() - seen:.0f} s after the "
          "job first showed on the Fleet page")
    screenshot(page, "demo_profile_differential")


def the_alert_says_where_its_time_goes(page) -> None:
    """The slow-rank alert names the function only the slow rank runs, from the sampled stacks, and
    its link opens that rank's profile against its peers over the incident with the function on top."""
    wait_for_text(page, re.compile(r"^Where its time goes.*slow_extra_compute"), 240)
    # A compute straggler (6x its peers' work) on a busy host is not called starved of CPU.
    assert "oversubscribed" not in page.inner_text("body")
    link = page.get_by_role("link", name=re.compile("Profile of rank 1 against its peers")).first
    href = link.get_attribute("href") or ""
    assert "profile_rank=1" in href and "profile_from=" in href, href
    page.goto(urljoin(page.url, href))     # a link to the page it is on: open it as a user's new tab would
    wait_for_text(page, MOST_ADDED, 120)


def request_window(page, base: str, job: str) -> str:
    """Trace windows page: request a 3-step window on every rank; returns the request's id.

    Requested once the profile has shown the slow rank's function (a window's own work on the
    training thread would enter the first profile intervals), before the slower checks: the window
    must run while every rank still steps, before the planted hang, on a slow machine too."""
    page.goto(f"{base}/traces?job={job}")
    wait_for_text(page, "Request a trace window", 60)
    page.get_by_role("button", name=re.compile("Request window")).first.click()
    ack = wait_for_text(page, re.compile(r"Request tw[0-9a-f]{8}"), 60)
    screenshot(page, "demo_traces")
    return re.search(r"tw[0-9a-f]{8}", ack.inner_text()).group(0)


def find_report(page, base: str, job: str, request_id: str) -> None:
    """Reports page: the requested window's report shows."""
    deadline = time.monotonic() + 180
    while True:
        page.goto(f"{base}/reports?job={job}&window={request_id}")   # other reports (automatic windows) may be newer
        try:
            wait_for_text(page, request_id, 10)
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
    screenshot(page, "demo_report")
