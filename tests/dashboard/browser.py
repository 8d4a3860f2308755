"""Headless Chromium for dashboard tests (a helper module, not a test).

Playwright drives Debian's ``/usr/bin/chromium`` (``playwright install`` cannot download browsers
here). Streamlit fills the page over a websocket after load, so wait for text, never for a fixed
delay. A missing browser raises, so browser tests fail rather than skip.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.job_page import CHARTS_JS, CHROMIUM, CHROMIUM_ARGS

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


@contextmanager
def launch_browser(width: int = 1440, height: int = 1000) -> Iterator[Any]:
    """Yield a Playwright ``Page`` in a fresh headless Chromium; closes everything on exit.

    Raises FileNotFoundError when Chromium is missing (tests must fail, not skip).
    """
    if not Path(CHROMIUM).exists():
        raise FileNotFoundError(f"Chromium not found at {CHROMIUM}: apt-get install -y chromium "
                                "(or set RANKSCOPE_CHROMIUM)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(viewport={"width": width, "height": height})
            page = context.new_page()
            yield page
        finally:
            browser.close()


def wait_for_text(page: Any, text: str | re.Pattern[str], timeout_s: float = 30.0) -> Any:
    """Wait until a visible element shows ``text`` (substring or regex); return its locator.

    Raises AssertionError naming the text, the URL and how long it waited.
    """
    from playwright.sync_api import Error as PwError

    # Any visible match counts: the first match in the DOM may be hidden (a collapsed expander, the
    # data grid's accessibility table), and which comes first depends on rendering order.
    matches = page.get_by_text(text)
    t0 = time.monotonic()
    while True:
        try:
            for loc in matches.all():
                if loc.is_visible():
                    return loc
        except PwError:             # an element went away between all() and is_visible()
            pass
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"text {text!r} not visible on {page.url} after {time.monotonic() - t0:.1f} s")
        time.sleep(0.25)


def wait_for_charts(page: Any, timeout_s: float = 30.0, at_least: int = 1) -> int:
    """Wait until at least ``at_least`` charts are on the page and every one has drawn (Vega-Lite
    charts and the server's SVGs, counted as the Job page benchmark counts them:
    :data:`benchmarks.job_page.CHARTS_JS`); return the count.

    Charts draw asynchronously after their element appears, so a capture taken on text alone can
    show empty chart slots; and a page's later charts arrive after its earlier text, so a count taken
    as soon as the charts present have drawn can miss them.
    """
    page.wait_for_function(f"(atLeast) => {{ const c = ({CHARTS_JS})(); return c.present >= atLeast && "
                           "c.drawn === c.present; }", arg=at_least, timeout=timeout_s * 1000)
    return int(page.evaluate(CHARTS_JS)["drawn"])


def screenshot(page: Any, name: str, full_page: bool = True) -> Path:
    """Save a PNG of the page under tests/artifacts/<name>.png and return its path.

    Streamlit scrolls inside its ``stMain`` element, not the document, so a full-page capture
    first grows the viewport to the content height, then restores it.
    """
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    size = page.viewport_size
    tall = None
    if full_page and size:
        tall = page.evaluate(
            "() => { const m = document.querySelector('[data-testid=\"stMain\"]');"
            " return m ? m.scrollHeight : document.documentElement.scrollHeight; }")
    if tall and tall > size["height"]:
        page.set_viewport_size({"width": size["width"], "height": min(int(tall), 12000)})
        page.wait_for_timeout(700)  # let charts re-layout
    try:
        page.screenshot(path=str(path), full_page=full_page)
    finally:
        if tall and size and tall > size["height"]:
            page.set_viewport_size(size)
    return path
