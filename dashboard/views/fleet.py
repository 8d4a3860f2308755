"""Fleet overview: jobs (with links to their pages), hosts, and GPU utilisation across the fleet."""

from functools import partial

import altair as alt
import streamlit as st

from rankscope.config import Settings
from rankscope.dashboard import queries, ui

MAX_GPU_ROWS = 64     # rows of the GPU heatmap


def panel(cfg: Settings, span: ui.TimeRange) -> None:
    jobs = ui.query(cfg, "jobs")
    if jobs.empty:
        st.info(ui.EMPTY_FLEET, icon="🛰️")
        return
    hosts = ui.query(cfg, "hosts")
    since, until = span.bounds()
    window_s = (until - since) / 1e9
    now_ns = until if span.key == "custom" else None
    # Thousands of GPUs: the heatmap shows the MAX_GPU_ROWS least used; the metric covers them all.
    gpu = ui.query(cfg, "gpu_util_series", window_s=window_s, bucket_s=queries.bucket_for(window_s, points=120),
                   now_ns=now_ns, max_gpus=MAX_GPU_ROWS)
    summary = ui.query(cfg, "gpu_util_summary", window_s=window_s, now_ns=now_ns)
    gpus_total = int(summary["gpus"].iloc[0]) if not summary.empty else 0
    fleet_util = float(summary["gpu_util"].iloc[0]) if not summary.empty else float("nan")
    live_ranks = int(hosts["live_ranks"].sum()) if not hosts.empty else 0
    c = st.columns(5)
    c[0].metric("Jobs", len(jobs))
    c[1].metric("Live ranks", live_ranks)
    c[2].metric("Hosts", len(hosts))
    c[3].metric("Open alerts", int(jobs["open_alerts"].sum()))
    c[4].metric("GPU utilisation", f"{fleet_util:.0f} %" if gpus_total and fleet_util == fleet_util else "n/a",
                help=f"Mean over every GPU sample of the {span.label} (hw_samples metric gpu_util).")

    st.subheader("Jobs")
    shown = jobs.head(24)
    cols = st.columns(4)
    for i, j in enumerate(shown.itertuples()):
        alerts = f" · {j.open_alerts} open alert{'s' if j.open_alerts != 1 else ''}" if j.open_alerts else ""
        with cols[i % 4]:
            st.page_link(ui.JOB_PAGE, label=f"{j.job}{alerts}", query_params={"job": str(j.job)},
                         icon=":material/warning:" if j.open_alerts else ":material/check_circle:")
    if len(jobs) > len(shown):
        st.caption(f"{len(jobs) - len(shown)} more jobs in the table below; pick them on the Job page.")
    table = jobs.assign(last_seen=jobs["last_seen_age_s"].map(ui.ago))
    st.dataframe(
        table[["job", "world_size", "ranks_seen", "last_step", "open_alerts", "alerts_total", "last_seen"]],
        hide_index=True,
        column_config={"job": "Job", "world_size": "World size", "ranks_seen": "Ranks seen",
                       "last_step": "Last step", "open_alerts": "Open alerts", "alerts_total": "Alerts",
                       "last_seen": "Last seen"},
    )

    st.subheader("Hosts")
    if hosts.empty:
        st.caption("No hosts yet.")
    else:
        st.dataframe(
            hosts.assign(last_seen=hosts["last_seen_age_s"].map(ui.ago), link="host?host=" + hosts["host"].astype(str))
            .drop(columns=["last_seen_age_s"]),
            hide_index=True,
            column_config={
                "host": "Host", "link": st.column_config.LinkColumn("Host page", display_text="open"), "ranks": "Ranks", "live_ranks": "Live ranks", "jobs": st.column_config.ListColumn("Jobs"),
                "gpus": "GPUs",
                "gpu_util_mean": st.column_config.ProgressColumn("GPU util (mean)", format="%.0f %%",
                                                                 min_value=0, max_value=100),
                "gpu_util_min": st.column_config.NumberColumn("Min GPU", format="%.0f %%"),
                "gpu_util_max": st.column_config.NumberColumn("Max GPU", format="%.0f %%"),
                "last_seen": "Last seen",
            },
        )

    st.subheader("GPU utilisation")
    if gpu.empty:
        st.caption(f"No GPU samples in the {span.label} (the hardware sampler sends metric `gpu_util`).")
    else:
        chart = (
            alt.Chart(gpu)
            .mark_rect()
            .encode(
                x=alt.X("t:T", title=None, axis=alt.Axis(format="%H:%M:%S", tickCount=8)),
                y=alt.Y("gpu:N", title="host/GPU", sort="ascending"),
                color=alt.Color("gpu_util:Q", title="util %", scale=alt.Scale(domain=[0, 100], scheme="viridis")),
                tooltip=["gpu", alt.Tooltip("t:T", format="%H:%M:%S"), "gpu_util"],
            )
            .properties(height=max(160, 30 * gpu["gpu"].nunique()))
        )
        st.altair_chart(chart, width="stretch")
        if gpus_total > gpu["gpu"].nunique():
            st.caption(f"The {gpu['gpu'].nunique()} GPUs of {gpus_total:,} with the lowest mean utilisation in the "
                       f"{span.label}; the fleet's mean is {fleet_util:.0f} %. Each host's GPUs are in the table "
                       "above and on its Host page.")


st.title("Fleet overview")
cfg = ui.connect()
if cfg is not None:
    ui.live(cfg, partial(panel, cfg, ui.time_range()))
