"""Job view: rank states, per-rank step and busy time, open alerts with grouped stacks, lost time, and
the ranks' sampled stacks (the profile panel: a flame graph, and one rank against its peers).

The job comes from ``?job=`` (links from the fleet page) or the picker, which keeps the URL in step.
"""

from dataclasses import replace
from functools import partial

import altair as alt
import pandas as pd
import streamlit as st

from rankscope.config import Settings
from rankscope.dashboard import profile_panel, queries, svg_charts, ui
from rankscope.dashboard.job_queries import heatmap_args, ranks_args, world_of
from rankscope.rank_states import RANK_STATES, RUNNING

TABLE_MAX_RANKS = queries.HEATMAP_MIN_RANKS   # a plain table up to here, a scrolling data grid above
ROWS_IN_VIEW = 12          # rows the grid shows before it scrolls: past them, the abnormal ranks come first
STYLED_MAX_RANKS = 1024    # state cells coloured up to here (pandas' Styler takes ~0.2 ms a row to send)
RANKS_PER_REFRESH_S = 1000
RANKS_SHOWN = "job_ranks_shown"   # (job, ranks frame) the panel drew in this run: the profile's rank picker reuses it


def refresh_s(cfg: Settings, job: str) -> float:
    """How often the live panel reruns: the configured period, and a second per 1,000 ranks beyond it
    (a rerun of a 10,000-rank job's panel costs the server ~0.5 s and the browser ~1 s)."""
    try:
        world = world_size(cfg, job)
    except queries.StoreError:
        return cfg.dashboard_refresh_s
    return max(cfg.dashboard_refresh_s, world / RANKS_PER_REFRESH_S)


def by_severity(ranks: pd.DataFrame) -> pd.DataFrame:
    """The ranks not running first, most severe state first (rankscope.rank_states), then by rank."""
    severity = {s: i for i, s in enumerate(RANK_STATES)}
    ranks = ranks.assign(_order=ranks["state"].map(severity).fillna(len(severity)))
    return ranks.sort_values(["_order", "rank"], kind="stable").drop(columns="_order")


def ranks_first(ranks: pd.DataFrame, limit: int = 50) -> list[int]:
    """Up to ``limit`` ranks not running, most severe first (hung and slow before waiting)."""
    shown = by_severity(ranks[ranks["state"] != RUNNING]) if not ranks.empty else ranks
    return [int(r) for r in shown["rank"].head(limit)]


def ranks_table(ranks: pd.DataFrame) -> None:
    if len(ranks) > ROWS_IN_VIEW and len(ranks) > TABLE_MAX_RANKS:
        ranks = by_severity(ranks)
        normal = int((ranks["state"] == RUNNING).sum())
        other = len(ranks) - normal
        st.caption((f"The {other:,} rank{'s' if other != 1 else ''} not running come first, most severe first"
                    + (f"; then the {normal:,} running ones by rank" if normal else "") if other
                    else f"All {normal:,} ranks running, by rank") + ". Click a column to sort by it.")
    if len(ranks) <= TABLE_MAX_RANKS:
        st.table(pd.DataFrame({
            "rank": ranks["rank"].astype(str),
            "state": ranks["state"].map(lambda s: ui.STATE_BADGE.get(s, s)),
            "host": ranks["host"],
            "pid": ranks["pid"].astype(str),
            "last step": ranks["last_step"].astype(str),
            "step ms (median)": ranks["median_step_ms"].map("{:.1f}".format),
            "busy ms (median)": ranks["median_busy_ms"].map("{:.1f}".format),
            "busy z": ranks["busy_z"].map(lambda z: "" if pd.isna(z) else f"{z:+.1f}"),
            "CPU wait %": ranks["cpu_wait_pct"].map(lambda w: "" if pd.isna(w) else f"{w:.0f}"),
            "heartbeat": ranks["heartbeat_age_s"].map(ui.ago),
            "alerts": ranks["alerts"],
            "exit": (ranks["exit_reason"] + " " + ranks["exit_detail"]).str.strip(),
        }), hide_index=True)
        return
    grid = compact_grid(ranks.reset_index(drop=True))   # a range index is not sent
    config = {"rank": st.column_config.NumberColumn(format="%d"), "pid": st.column_config.NumberColumn(format="%d"),
              "last step": st.column_config.NumberColumn(format="%d"),
              "step ms (median)": st.column_config.NumberColumn(format="%.1f"),
              "busy ms (median)": st.column_config.NumberColumn(format="%.1f"),
              "busy z": st.column_config.NumberColumn(format="%+.1f"),
              "CPU wait %": st.column_config.NumberColumn(
                  format="%.0f", help="of the time in the last 30 s the rank's training thread was ready to run, the share it waited for a CPU"),
              "heartbeat s ago": st.column_config.NumberColumn(format="%.0f")}
    if len(ranks) > STYLED_MAX_RANKS:
        st.dataframe(grid, hide_index=True, height=420, column_config=config)
        return
    colours = ranks["state"].map(ui.STATE_COLOUR).fillna("").tolist()
    styled = grid.style.apply(lambda _c: [f"background-color: {c}" for c in colours], subset=["state"])
    st.dataframe(styled, hide_index=True, height=420, column_config=config)


def compact_grid(ranks: pd.DataFrame) -> pd.DataFrame:
    """The data grid's columns, as numbers the grid formats itself (a column sorts by value) in the
    narrowest types that hold them: 32-bit numbers, and the strings that repeat (state, host, alerts,
    exit) as categories, which Arrow sends once each. For 10,000 ranks the browser receives and
    decodes ~0.4 MB instead of 1.1 MB."""
    def whole(col: str, dtype: str = "int32") -> pd.Series:
        return pd.to_numeric(ranks[col], errors="coerce").fillna(0).astype(dtype)

    def f32(col: str) -> pd.Series:
        return pd.to_numeric(ranks[col], errors="coerce").astype("float32")

    def category(values: pd.Series) -> pd.Series:
        return values.fillna("").astype(str).astype("category")

    return pd.DataFrame({
        "rank": whole("rank"), "state": category(ranks["state"]), "host": category(ranks["host"]),
        "pid": whole("pid"), "last step": whole("last_step", "int64"),
        "step ms (median)": f32("median_step_ms"), "busy ms (median)": f32("median_busy_ms"), "busy z": f32("busy_z"),
        "CPU wait %": f32("cpu_wait_pct"), "heartbeat s ago": f32("heartbeat_age_s"),
        "alerts": category(ranks["alerts"]),
        "exit": category((ranks["exit_reason"].fillna("") + " " + ranks["exit_detail"].fillna("")).str.strip()),
    })


def step_charts(cfg: Settings, job: str, world: int) -> None:
    metrics = [("busy_ms", "busy ms"), ("step_ms", "step ms"), ("comm_ms", "collective wait ms")]
    names = ["Busy time (compute)", "Step time", "Collective wait"]
    if world > queries.HEATMAP_MIN_RANKS:
        # Only the open tab's heatmap is drawn (picking another reruns the panel): each is a chart
        # the browser lays out, and the panel refreshes.
        tabs = st.tabs(names, key="step_chart_tab", on_change="rerun")
        frame = ui.query(cfg, "step_time_heatmaps", **heatmap_args(job, world))
        binned = "ranks" in frame.columns
        rows = frame["rank"].nunique() if not frame.empty else 0
        for tab, (metric, title) in zip(tabs, metrics, strict=True):
            if tab.open is False:
                continue
            with tab:
                if frame.empty:
                    st.caption("No steps recorded yet.")
                    continue
                worst = "slowest" if queries.HEATMAP_WORST[metric] == "max" else "shortest-waiting"
                svg_charts.show(svg_charts.heatmap_svg(
                    frame, metric, title, row_label="ranks" if binned else "rank",
                    row_names="ranks" if binned else None, worst=f"worst_{metric}" if binned else None,
                    worst_title=f"{worst} rank"))
                if binned:
                    st.caption(f"{world:,} ranks in {rows} bins; each cell shows its bin's {worst} rank "
                               "(named in the tooltip), so one slow rank colours its bin.")
        return
    tabs = st.tabs(names)
    frame = ui.query(cfg, "step_times", job=job)
    if frame.empty:
        st.caption("No steps recorded yet.")
        return
    for tab, (metric, title) in zip(tabs, metrics, strict=True):
        with tab:
            chart = alt.Chart(frame).mark_line(point=len(frame) < 400).encode(
                x=alt.X("step:Q", title="step"), y=alt.Y(f"{metric}:Q", title=title),
                color=alt.Color("rank:N", title="rank", scale=alt.Scale(scheme="category10")),
                tooltip=["rank", "step", metric])
            st.altair_chart(chart.properties(height=280), width="stretch")
    st.caption("In synchronous training every rank shows the same step time; the slow rank is the one "
               "with the longest busy time and the shortest collective wait.")


def flight_panel(cfg: Settings, job: str) -> None:
    """The ranks' latest step histories: their last step records and every thread's stack (sent
    when a hang alert or a request asks; PyTorch's Flight Recorder dumps are on the Alerts page)."""
    flights = ui.query(cfg, "flight_records", job=job)
    if flights.empty:
        return
    with st.expander(f"Step histories ({len(flights)} rank{'s' if len(flights) > 1 else ''})"):
        st.dataframe(flights.drop(columns=["stacks"]), hide_index=True,
                     column_config={"rank": "Rank", "sent": "Sent", "request_id": "Request", "reason": "Reason",
                                    "steps": "Step records", "first_step": "First step", "last_step": "Last step"})
        for row in flights.itertuples():
            main = [t for t in row.stacks if isinstance(t, dict) and t.get("thread") == "MainThread"]
            if main:
                st.markdown(f"**Rank {row.rank}**, main thread at its last dump")
                st.markdown(ui.stack_markdown([str(f) for f in main[0].get("frames", [])]))


def world_size(cfg: Settings, job: str) -> int:
    """The job's world size from the jobs query (0: not known)."""
    return world_of(ui.query(cfg, "jobs"), job)


def panel(cfg: Settings, job: str) -> None:
    ranks = ui.query(cfg, "ranks", **ranks_args(cfg, job))
    st.session_state[RANKS_SHOWN] = (job, ranks)
    alerts = ui.query(cfg, "alerts", job=job)
    world = world_size(cfg, job) or len(ranks)
    open_alerts = alerts[alerts["open"]] if not alerts.empty else alerts

    c = st.columns(5)
    c[0].metric("World size", world)
    c[1].metric("Ranks seen", len(ranks))
    c[2].metric("Last step", int(ranks["last_step"].max()) if not ranks.empty else 0)
    c[3].metric("Open alerts", len(open_alerts))
    c[4].metric("Median step", f"{ranks['median_step_ms'].median():.1f} ms" if not ranks.empty else "n/a")
    if ranks.empty:
        st.info("No ranks of this job have reported yet. Ranks appear after their first heartbeat.")
        return
    st.markdown(ui.state_counts_line(ranks))

    st.subheader("Ranks")
    ranks_table(ranks)

    st.subheader("Step time per rank")
    step_charts(cfg, job, max(world, len(ranks)))

    st.subheader("Alerts")
    if alerts.empty:
        st.caption("No alerts for this job: no hang, dead rank or straggler detected.")
        flight_panel(cfg, job)
        return
    groups = queries.parse_stack_groups(alerts)
    lost = queries.lost_time(alerts, {job: world})
    lost_by_id = dict(zip(lost["alert_id"], lost["lost_rank_seconds"], strict=True))
    state = dict(zip(ranks["rank"].astype(int), ranks["state"], strict=True))
    if open_alerts.empty:
        st.caption("No open alerts.")
    for _, a in open_alerts.iterrows():
        ui.render_alert(a, groups, rank_state=state, lost_s=lost_by_id.get(a["alert_id"]))
    resolved = alerts[~alerts["open"]]
    if not resolved.empty:
        with st.expander(f"Resolved alerts ({len(resolved)})"):
            for _, a in resolved.iterrows():
                ui.render_alert(a, groups, lost_s=lost_by_id.get(a["alert_id"]))

    st.subheader("Lost time")
    st.metric("Lost rank-seconds (all alerts)", f"{lost['lost_rank_seconds'].sum():,.1f}")
    # A few rows: a plain table (a data grid is a canvas widget the browser builds and draws).
    st.table(pd.DataFrame({
        "Alert": lost["alert_id"], "Kind": lost["kind"],
        "State": lost["status"].map(lambda s: "resolved" if s == "resolved" else "open"),
        "Ranks": lost["ranks"].map(ui.rank_list), "Step": lost["step"].astype(str),
        "Duration s": lost["duration_s"].map("{:.0f}".format),
        "Lost rank-s": lost["lost_rank_seconds"].map("{:,.1f}".format),
        "Estimated": lost["estimated"].map(lambda e: "yes" if e else ""),
    }), hide_index=True)
    flight_panel(cfg, job)


st.title("Job")
cfg = ui.connect()
chosen = ui.choose_job(cfg) if cfg is not None else None
if cfg is not None and chosen is not None:
    ui.live(replace(cfg, dashboard_refresh_s=refresh_s(cfg, chosen)), partial(panel, cfg, chosen))
    st.subheader("Profile")
    try:
        shown = st.session_state.get(RANKS_SHOWN)
        seen = shown[1] if shown and shown[0] == chosen else ui.query(cfg, "ranks", **ranks_args(cfg, chosen))
        ranks = sorted(int(r) for r in seen["rank"]) if not seen.empty else []
        # The ranks not running (most severe first) lead the picker of a large job.
        first = ranks_first(seen) if len(ranks) > profile_panel.MAX_RANK_OPTIONS else []
        profile_panel.render(cfg, chosen, ranks, first=first)
    except queries.StoreError as e:
        st.warning(f"The store did not answer: {e}")
