"""All alerts across jobs: open incidents as cards with grouped stacks, everything in one table."""

from functools import partial

import streamlit as st

from rankscope.config import Settings
from rankscope.dashboard import queries, ui

KINDS = ui.KIND_TITLE


def panel(cfg: Settings, kinds: list[str], show_resolved: bool) -> None:
    alerts = ui.query(cfg, "alerts")
    if alerts.empty:
        st.info("No alerts yet. rankscope opens one when a rank hangs, dies, or falls behind the others; "
                "the Fleet overview shows the jobs it watches.", icon="✅")
        return
    jobs = ui.query(cfg, "jobs")
    lost = queries.lost_time(alerts, dict(zip(jobs["job"], jobs["world_size"], strict=True)))
    lost_by_id = dict(zip(lost["alert_id"], lost["lost_rank_seconds"], strict=True))
    c = st.columns(4)
    c[0].metric("Open", int(alerts["open"].sum()))
    c[1].metric("Resolved", int((~alerts["open"]).sum()))
    c[2].metric("Jobs affected", alerts.loc[alerts["open"], "job"].nunique())
    c[3].metric("Lost rank-seconds", f"{lost['lost_rank_seconds'].sum():,.1f}")

    shown = alerts[alerts["kind"].isin(kinds)] if kinds else alerts
    if not show_resolved:
        shown = shown[shown["open"]]
    if shown.empty:
        st.caption("No alerts match the filters.")
        return
    table = shown.assign(ranks=shown["ranks"].map(ui.rank_list),
                         state=shown["open"].map({True: "open", False: "resolved"}),
                         kind=shown["kind"].map(lambda k: KINDS.get(k, k)),
                         lost_rank_seconds=shown["alert_id"].map(lost_by_id),
                         link="job?job=" + shown["job"].astype(str))
    st.dataframe(
        table[["job", "kind", "state", "severity", "ranks", "step", "opened", "duration_s",
               "lost_rank_seconds", "link", "summary"]],
        hide_index=True,
        column_config={
            "job": "Job", "kind": "Kind", "state": "State", "severity": "Severity", "ranks": "Ranks",
            "step": "Step", "summary": "Summary",
            "opened": st.column_config.DatetimeColumn("Opened (UTC)", format="YYYY-MM-DD HH:mm:ss"),
            "duration_s": st.column_config.NumberColumn("Duration s", format="%.0f"),
            "lost_rank_seconds": st.column_config.NumberColumn("Lost rank-s", format="%.1f"),
            "link": st.column_config.LinkColumn("Job page", display_text="open"),
        },
    )
    open_ = shown[shown["open"]]
    if not open_.empty:
        st.subheader("Open incidents")
        groups = queries.parse_stack_groups(open_)
        hangs = open_[open_["kind"].isin(["hang", "collective_mismatch"])]
        collectives = ui.query(cfg, "incident_collectives",
                               incidents=tuple(zip(hangs["job"], hangs["alert_id"], strict=True)))
        for _, a in open_.iterrows():
            ui.render_alert(a, groups, lost_s=lost_by_id.get(a["alert_id"]), job_link=True, collectives=collectives)


st.title("Alerts")
cfg = ui.connect()
if cfg is not None:
    f = st.columns([3, 1])
    picked = f[0].multiselect("Kinds", list(KINDS), format_func=lambda k: KINDS[k], placeholder="all kinds")
    resolved = f[1].toggle("Show resolved", value=True)
    ui.live(cfg, partial(panel, cfg, picked, resolved))
