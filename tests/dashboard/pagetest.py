"""AppTest helpers shared by the page tests (a helper module, not a test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamlit.testing.v1 import AppTest

from rankscope.dashboard.svg_charts import svg_of

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")


def open_page(page: str | None = None, **query: str) -> AppTest:
    """Run the app on ``page`` (default: the fleet overview) with ``?query`` parameters."""
    at = AppTest.from_file(APP, default_timeout=60)
    for k, v in query.items():
        at.query_params[k] = v
    if page:
        at.switch_page(page)
    return at.run()


def page_text(at: AppTest) -> str:
    """Every text a reader sees: markdown, code, captions, notices, metrics, tables, page links."""
    parts = [m.value for m in at.markdown] + [m.value for m in at.caption]
    parts += [e.value for e in at.info] + [e.value for e in at.warning] + [e.value for e in at.error]
    parts += [str(m.label) + " " + str(m.value) for m in at.metric]
    parts += [t.value.to_string() for t in at.table]
    parts += [str(p.proto.label) for p in at.get("page_link")]
    return "\n".join(str(p) for p in parts)


def stacks(at: Any) -> list[str]:
    """The stacks a page shows (rankscope.dashboard.ui.stack_markdown: one code span per frame), each
    a paragraph of its own in an alert card's Markdown."""
    return [p for m in at.markdown for p in m.value.split("\n\n") if p.startswith("`` ")]


def drawn_svgs(at: AppTest, kind: str) -> list[str]:
    """The server-drawn SVG charts of one kind on a page (rankscope.dashboard.svg_charts: ``heatmap``
    or ``flame``), as the HTML elements that show them carry them."""
    drawings = [svg_of(e.proto.body) for e in at.get("html")]
    return [d for d in drawings if f'class="rs-{kind}"' in d]
