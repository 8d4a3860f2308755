"""Reports: the query, splitting a body into sections, and the page (including its empty state)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import sample_data as sd
from pagetest import open_page, page_text

from rankscope.dashboard import queries as q


@pytest.mark.clickhouse
def test_reports_query(store, empty_store):
    df = q.reports(store)
    assert list(df.columns) == q.REPORTS_COLUMNS
    assert list(df["job"]) == [sd.HANG_JOB] and list(df["window_id"]) == [sd.WINDOW_ID]
    assert json.loads(df["body"].iloc[0])["schema"] == "rankscope.analyze/1"
    assert q.reports(store, job=sd.OK_JOB).empty
    assert list(q.reports(empty_store).columns) == q.REPORTS_COLUMNS


def test_report_sections_shapes():
    secs = q.report_sections(json.dumps(sd.sample_report()))
    by = {s.title: s for s in secs}
    assert secs[0].title == "Summary" and secs[0].kind == "fields"
    summary = dict(zip(secs[0].data["name"], secs[0].data["value"], strict=True))
    assert summary["schema"] == "rankscope.analyze/1" and summary["ranks"] == "0, 1, 2, 3"
    assert by["temporal_breakdown"].kind == "table" and len(by["temporal_breakdown"].data) == 4
    assert list(by["top_kernels"].data.columns) == ["rank", "name", "sum (us)"]
    assert by["convention"].kind == "fields"
    assert by["departures_from_hta"].kind == "fields"


def test_report_sections_nested_and_odd_bodies():
    body = {"per_rank": {"0": [{"a": 1, "b": {"x": 1}}], "note": "n"}, "empty": [], "mixed": [{"a": 1}, 2]}
    by = {s.title: s for s in q.report_sections(body)}
    assert by["per_rank"].kind == "fields" and list(by["per_rank"].data["name"]) == ["note"]
    assert by["per_rank / 0"].kind == "table" and by["per_rank / 0"].data.iloc[0]["b"] == '{"x":1}'
    assert list(by["Summary"].data["name"]) == ["empty"] and by["mixed"].kind == "json"
    [bad] = q.report_sections("not json {")
    assert bad.kind == "json" and bad.data == "not json {"
    [arr] = q.report_sections("[1, 2]")
    assert arr.kind == "json" and arr.data == [1, 2]
    [recs] = q.report_sections(b'[{"a": 1}]')
    assert recs.kind == "table" and isinstance(recs.data, pd.DataFrame)


@pytest.mark.clickhouse
def test_reports_page(app_env):
    at = open_page("views/reports.py")
    assert not at.exception, at.exception
    text = page_text(at)
    assert sd.WINDOW_ID in text and "1 report" in text
    subheaders = [s.value for s in at.subheader]
    assert subheaders[:3] == ["Summary", "convention", "temporal breakdown"]
    assert len(at.dataframe) == 1 + 5  # the list, then the sections
    assert at.dataframe[3].value["idle_time_pctg"].tolist() == [5.0, 6.0, 7.0, 8.0]
    assert at.get("download_button")


@pytest.mark.clickhouse
def test_reports_page_empty_state(app_env, monkeypatch):
    monkeypatch.setattr(q, "reports", lambda store, **kw: pd.DataFrame(columns=q.REPORTS_COLUMNS))
    at = open_page("views/reports.py")
    assert not at.exception
    assert any("rankscope trace --job J --steps 3 --auto-analyze" in i.value for i in at.info)


# A window diagnosis: verdict, charts, PerfTracker's sections, downloads ------------------------------

def diagnosis_report() -> dict:
    """A live report of 4 workers with rank 2 slow (the analyzer's own output, not a hand-made dict)."""
    from rankscope.stream_processors.analysis.report import build_report

    rows, arrivals = [], []
    for r in range(4):
        extra = 30_000_000 if r == 2 else 0
        rows += [{"rank": r, "category": "cpu_op", "name": "aten::mm", "count": 100, "total_ns": 38_000_000 + extra,
                  "exclusive_ns": 38_000_000 + extra, "window_ns": 100_000_000},
                 {"rank": r, "category": "collective", "name": "gloo:all_reduce", "count": 10,
                  "total_ns": 50_000_000 - extra, "exclusive_ns": 40_000_000, "window_ns": 100_000_000}]
        arrivals += [{"rank": r, "name": "c10d::allreduce_", "seq": k, "start_ns": k * 10**7 + (3 * 10**6 if r == 2 else r)}
                     for k in range(10)]
    return build_report(pd.DataFrame(rows), pd.DataFrame(arrivals), job="dj", window_id="w-diag")


def test_report_headline_of_bodies():
    assert q.report_headline(json.dumps(diagnosis_report())).startswith("Slow worker: rank 2")
    assert q.report_headline(json.dumps(sd.sample_report())) == "GPU time breakdown (no diagnosis)"
    assert q.report_headline("not json {") == "not JSON"


@pytest.mark.clickhouse
def test_reports_page_reads_like_a_diagnosis(app_env, monkeypatch):
    body = json.dumps(diagnosis_report())
    monkeypatch.setattr(q, "reports", lambda store, **kw: pd.DataFrame(
        {"job": ["dj"], "window_id": ["w-diag"], "created": [pd.Timestamp("2026-01-01")], "created_ns": [0],
         "body": [body]}))
    at = open_page("views/reports.py")
    assert not at.exception, at.exception
    subheaders = [s.value for s in at.subheader]
    assert subheaders[:3] == ["Verdict", "Slow workers", "Causes, by cost"], subheaders
    assert "Collective arrivals" in subheaders and "Communication, by collective" in subheaders
    [headline] = [e.value for e in at.error]
    assert headline.startswith("**Slow worker: rank 2; top cause `aten::mm`") and "rank-seconds" in headline
    assert "straggler at collectives: rank 2" in headline
    text = page_text(at)
    assert "Rank 2 is slow" in text and "Straggler at collectives: rank 2" in text
    slow = at.dataframe[1].value                  # the list first, then the sections' tables
    assert slow["rank"].tolist() == [2] and "busy (ms)" in slow.columns
    assert len(at.get("download_button")) == 2    # JSON and Markdown
    assert len(at.get("vega_lite_chart")) == 3


def test_reports_page_window_link_picks_that_report(app_env, monkeypatch):
    body = json.dumps(diagnosis_report())
    monkeypatch.setattr(q, "reports", lambda store, **kw: pd.DataFrame(
        {"job": ["dj", "dj"], "window_id": ["auto-dj-1-0", "tw12ab34cd-0"],
         "created": [pd.Timestamp("2026-01-01 00:00:02"), pd.Timestamp("2026-01-01 00:00:01")],
         "created_ns": [2, 1], "body": [body, body]}))
    newest = page_text(open_page("views/reports.py", job="dj"))
    assert "window `auto-dj-1-0`" in newest
    for link in ("tw12ab34cd", "tw12ab34cd-0"):           # the request id, or the window id
        at = open_page("views/reports.py", job="dj", window=link)
        assert not at.exception, at.exception
        assert "window `tw12ab34cd-0`" in page_text(at)
    assert "window `auto-dj-1-0`" in page_text(open_page("views/reports.py", job="dj", window="tw-none"))


# In a real browser, on a replayed multi-rank window ---------------------------------------------------

STORE_REPORT = r"""
import json, sys
from rankscope.storage.store import close_store, open_store
dsn, path = sys.argv[1], sys.argv[2]
rep = json.loads(open(path).read())
store = open_store(dsn)
store.insert("reports", [{"job": rep["job"], "window_id": rep["window_id"], "created_ns": int(rep["created_ns"]),
                          "body": json.dumps(rep)}])
close_store(dsn)
"""


@pytest.mark.kafka
@pytest.mark.browser
def test_reports_page_in_a_browser_on_a_replayed_window(kafka_settings, tmp_path):
    """4 recorded ranks (rank 3 time-dilated) replayed through real Kafka and processors; the report
    they build, stored in chDB, read on the Reports page in headless Chromium."""
    import subprocess
    import sys
    import time
    import uuid

    from browser import launch_browser, screenshot, wait_for_charts, wait_for_text
    from served import ROOT, free_port, served, streamlit_cmd

    from tests.integration.replayed import processors, replayed_report
    from tests.offline.trace_sets import slow_rank_set

    job = f"rb-{uuid.uuid4().hex[:6]}"
    with processors(kafka_settings, tmp_path, f"rb{uuid.uuid4().hex[:8]}.") as settings:
        rep = replayed_report(settings, job, f"rp{uuid.uuid4().hex[:6]}-0", slow_rank_set(tmp_path / "set"))
    assert [s["rank"] for s in rep["slow_workers"]] == [3] and rep["collective_arrivals"]["straggler"] == 3
    (tmp_path / "report.json").write_text(json.dumps(rep))
    dsn = f"chdb://{tmp_path / 'clickhouse'}"
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("RANKSCOPE_")}
    env.update({"PYTHONPATH": str(ROOT), "RANKSCOPE_CLICKHOUSE_DSN": dsn, "RANKSCOPE_DATA_DIR": str(tmp_path)})
    subprocess.run([sys.executable, "-c", STORE_REPORT, dsn, str(tmp_path / "report.json")], env=env, cwd=ROOT,
                   check=True, timeout=120, capture_output=True)
    port = free_port()
    with served(streamlit_cmd(port), port, env, tmp_path / "streamlit.log") as url, launch_browser() as page:
        page.goto(f"{url}/reports?job={job}")
        wait_for_text(page, "Verdict", 90)
        top = rep["causes"][0]
        wait_for_text(page, "Slow worker: rank 3")
        wait_for_text(page, f"{top['cost_rank_seconds']:.3f} rank-seconds")
        wait_for_text(page, "straggler at collectives: rank 3")
        wait_for_text(page, "Straggler at collectives: rank 3 arrives last")
        wait_for_text(page, "Collective arrivals")
        wait_for_text(page, "Bottleneck ratio per category")
        charts = page.locator('[data-testid="stVegaLiteChart"]')
        deadline = time.monotonic() + 60
        while charts.count() < 3 and time.monotonic() < deadline:    # they appear after the text
            page.wait_for_timeout(200)
        assert wait_for_charts(page, 60, at_least=3) == 3       # busy time, lateness, bottleneck ratio
        screenshot(page, "dashboard_reports_diagnosis")
