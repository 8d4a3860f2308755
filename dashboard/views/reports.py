"""Diagnosis reports, read like a diagnosis: the verdict first, then charts (busy time per rank,
collective lateness per rank, bottleneck ratio per category), PerfTracker's sections with units and
explanations, and JSON and Markdown downloads. The reading is :mod:`rankscope.report_view`'s, the
one ``rankscope report --format md`` prints."""

import json

import altair as alt
import pandas as pd
import streamlit as st

from rankscope import report_view
from rankscope.dashboard import queries, ui
from rankscope.storage.store import StoreError

ALL_JOBS = "all jobs"
EMPTY = ("**No reports yet.** A report is written when a trace window is analysed: open one on a running "
         "job with `rankscope trace --job J --steps 3 --auto-analyze` (or from the Trace windows page), "
         "then come back here.")
CHART_H = 220


def _bar(rows: list[dict], x: str, y: str, flag: str | None, title: str) -> None:
    df = pd.DataFrame(rows)
    enc = {"x": alt.X(f"{x}:N", title=x, sort=None, axis=alt.Axis(labelAngle=0 if x == "rank" else -40)),
           "y": alt.Y(f"{y}:Q", title=y),
           "tooltip": [alt.Tooltip(f"{x}:N"), alt.Tooltip(f"{y}:Q", format=",.3f")]}
    if flag:
        enc["color"] = alt.condition(alt.datum[flag], alt.value("#d62728"), alt.value("#4c78a8"))
    st.markdown(f"**{title}**")
    st.altair_chart(alt.Chart(df).mark_bar().encode(**enc).properties(height=CHART_H), width="stretch")


def render_diagnosis(report: dict) -> None:
    v = report_view.verdict(report)
    st.subheader("Verdict")
    (st.error if v.slow_ranks else st.success)(f"**{v.headline}**")
    st.markdown("\n".join(f"- {line}" for line in v.lines))
    charts = report_view.chart_data(report)
    c = st.columns(3)
    with c[0]:
        if charts["busy"]:
            _bar(charts["busy"], "rank", "busy (ms)", "slow", "Busy time per rank")
    with c[1]:
        if charts["lateness"]:
            _bar(charts["lateness"], "rank", "lateness (ms)", "straggler", "Collective lateness per rank")
        else:
            st.caption("No collective matched across ranks in this window: no lateness to chart.")
    with c[2]:
        if charts["bottleneck"]:
            _bar(charts["bottleneck"], "category", "bottleneck ratio (%)", None, "Bottleneck ratio per category")
    for s in report_view.sections(report):
        st.subheader(s.title)
        st.caption(s.explanation)
        if s.facts:
            st.markdown("\n".join(f"- **{label}**: {value}" for label, value in s.facts))
        if s.rows:
            st.dataframe(pd.DataFrame(s.rows), hide_index=True)
        elif not s.facts:
            st.markdown("_none_")
    diag = report_view.diagnosis_of(report) or {}
    if diag.get("not_applicable"):
        st.subheader("Not applicable")
        st.markdown("\n".join(f"- {x}" for x in diag["not_applicable"]))


def render(row: pd.Series) -> None:
    body = str(row["body"])
    try:
        report = json.loads(body)
    except ValueError:
        report = None
    c = st.columns([4, 1, 1])
    c[0].markdown(f"Job [{row['job']}](job?job={row['job']}) · window `{row['window_id']}` · created "
                  f"{row['created']:%Y-%m-%d %H:%M:%S} UTC")
    name = f"{row['job']}-{row['window_id']}.report"
    c[1].download_button("JSON", data=body.encode(), file_name=f"{name}.json", mime="application/json",
                         icon=":material/download:", on_click="ignore")
    diagnosed = isinstance(report, dict) and report_view.diagnosis_of(report) is not None
    if diagnosed:
        c[2].download_button("Markdown", data=report_view.render_markdown(report).encode(), file_name=f"{name}.md",
                             mime="text/markdown", icon=":material/download:", on_click="ignore")
        render_diagnosis(report)
        rest = {k: v for k, v in report.items() if k != "diagnosis"} if "diagnosis" in report else {}
        if rest:
            st.header("GPU time breakdown")
            _generic(rest)
    else:
        _generic(report if isinstance(report, dict) else body)


def preselected(shown: pd.DataFrame, window: str | None):
    """The row of the report a ``?window=`` link names: its window id, or the request id its windows
    are numbered from (``tw12ab34cd`` names ``tw12ab34cd-0``, the newest first); None when none matches."""
    if not window:
        return None
    ids = shown["window_id"].astype(str)
    hit = shown.index[(ids == window) | ids.str.startswith(f"{window}-")]
    return hit[0] if len(hit) else None


def _generic(body: dict | str) -> None:
    for section in queries.report_sections(body):
        st.subheader(section.title.replace("_", " "))
        if section.kind in ("table", "fields"):
            st.dataframe(section.data, hide_index=True)
        else:
            st.json(section.data, expanded=1)


st.title("Reports")
cfg = ui.connect()
if cfg is not None:
    try:
        reports = ui.query(cfg, "reports")
    except StoreError as e:
        st.warning(f"The store did not answer: {e}")
        reports = None
    if reports is not None and reports.empty:
        st.info(EMPTY, icon="📝")
    elif reports is not None:
        jobs = sorted({str(j) for j in reports["job"]})
        f = st.columns([1, 2])
        job = f[0].selectbox("Job", [ALL_JOBS, *jobs],
                             index=1 + jobs.index(st.query_params["job"]) if st.query_params.get("job") in jobs else 0)
        shown = reports if job == ALL_JOBS else reports[reports["job"] == job]
        labels = {i: f"{r.job} · {r.window_id} · {r.created:%Y-%m-%d %H:%M:%S}" for i, r in shown.iterrows()}
        st.dataframe(
            shown.assign(size=shown["body"].str.len(), verdict=shown["body"].map(queries.report_headline)),
            hide_index=True, column_order=["job", "window_id", "created", "verdict", "size"],
            column_config={"job": "Job", "window_id": "Window",
                           "created": st.column_config.DatetimeColumn("Created (UTC)", format="YYYY-MM-DD HH:mm:ss"),
                           "verdict": "Verdict", "size": st.column_config.NumberColumn("Bytes", format="%d")})
        ids = list(labels)
        wanted = preselected(shown, st.query_params.get("window"))
        pick = f[1].selectbox("Report", ids, index=ids.index(wanted) if wanted in ids else 0,
                              format_func=lambda i: labels[i])
        if pick is not None:
            render(shown.loc[pick])
        st.caption(f"{len(reports)} report{'s' if len(reports) != 1 else ''}; the SQL console reads them too: "
                   "`SELECT job, window_id, body FROM reports`.")
