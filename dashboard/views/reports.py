"""Diagnosis reports: one per analysed trace window; sections as tables, raw JSON to download."""

import pandas as pd
import streamlit as st

from dashboard import queries, ui
from storage.store import StoreError

ALL_JOBS = "all jobs"
EMPTY = ("**No reports yet.** A report is written when a trace window is analysed: open one on a running "
         "job with `rankscope trace --job J --steps 3 --auto-analyze` (or from the Trace windows page), "
         "then come back here.")


def render(row: pd.Series) -> None:
    body = str(row["body"])
    c = st.columns([3, 1])
    c[0].markdown(f"Job [{row['job']}](job?job={row['job']}) · window `{row['window_id']}` · created "
                  f"{row['created']:%Y-%m-%d %H:%M:%S} UTC")
    c[1].download_button("Raw JSON", data=body.encode(), file_name=f"{row['job']}-{row['window_id']}.report.json",
                         mime="application/json", icon=":material/download:", on_click="ignore")
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
            shown.assign(size=shown["body"].str.len(),
                         sections=shown["body"].map(lambda b: len(queries.report_sections(b)))),
            hide_index=True, column_order=["job", "window_id", "created", "sections", "size"],
            column_config={"job": "Job", "window_id": "Window",
                           "created": st.column_config.DatetimeColumn("Created (UTC)", format="YYYY-MM-DD HH:mm:ss"),
                           "sections": "Sections", "size": st.column_config.NumberColumn("Bytes", format="%d")})
        pick = f[1].selectbox("Report", list(labels), format_func=lambda i: labels[i])
        if pick is not None:
            render(shown.loc[pick])
        st.caption(f"{len(reports)} report{'s' if len(reports) != 1 else ''}; the SQL console reads them too: "
                   "`SELECT job, window_id, body FROM reports`.")
