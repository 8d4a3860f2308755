"""The profile panel of the Job and Host pages: the ranks' sampled Python stacks over the chosen time
range as a flame graph (all ranks or one, by thread role) and, for one rank, where it spends more
than its peers' median: the call paths that grew, ranked by added seconds, and the flame graph
coloured by them."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from rankscope import profiles
from rankscope.config import Settings
from rankscope.dashboard import flame, flame_chart, ui
from rankscope.protocol.profile import ROLES

ALL_RANKS = "all ranks"


def linked(key: str, options: list[str]) -> tuple[int, int]:
    """Follow a link from an alert (``?profile_rank=R&profile_from=NS[&profile_to=NS]``): preselect
    the rank once per link, and return the link's time bounds (0: none)."""
    qp = st.query_params
    rank = qp.get("profile_rank")
    if rank in options and st.session_state.get(f"_{key}_linked") != rank:
        st.session_state[f"{key}_rank"] = rank
        st.session_state[f"_{key}_linked"] = rank
    bounds = []
    for name in ("profile_from", "profile_to"):
        try:
            bounds.append(max(0, int(qp.get(name) or 0)))
        except ValueError:
            bounds.append(0)
    return bounds[0], bounds[1]


def render(cfg: Settings, job: str, ranks: list[int], host: str = "", key: str = "profile") -> None:
    rng = ui.time_range()
    t0, t1 = rng.bounds()
    options = [ALL_RANKS, *[str(r) for r in ranks]]
    since, until = linked(key, options)
    if since:
        t0 = max(t0, since)
        st.caption(f"From the alert's link: since {pd.Timestamp(since, unit='ns', tz='UTC'):%H:%M:%S} UTC"
                   + (f", until {pd.Timestamp(until, unit='ns', tz='UTC'):%H:%M:%S} UTC" if until else ""))
    if until:
        t1 = min(t1, until)
    c = st.columns([2, 3])
    pick = c[0].selectbox("Rank", options, key=f"{key}_rank",
                          help="One rank also shows where it spends more than its peers.")
    roles = c[1].multiselect("Threads", list(ROLES), default=["training"], key=f"{key}_roles",
                             help="training: the thread that calls tracer.step(); dataloader: DataLoader worker "
                                  "processes; pin_memory: the DataLoader's pin-memory thread; other: any other thread.")
    rows = ui.query(cfg, "profile_rows", job=job, t0_ns=t0, t1_ns=t1, roles=roles or None,
                    hosts=[host] if host else None)
    per = profiles.seconds(rows)
    if per.empty:
        st.caption("No sampled stacks in this range. Ranks sample their stacks all the time (`profile_hz`) and "
                   "send them every `profile_s` seconds.")
        return
    per = per.groupby(["rank", "path"], as_index=False)["seconds"].sum()
    if pick == ALL_RANKS:
        tree = flame.sampled_tree(per["path"].where(per["path"] != profiles.OTHER, ""), per["seconds"] * 1e9)
        flame_chart.icicle_chart(flame.icicle(tree), "rank-ms")
        return
    rank = int(pick)
    diff = profiles.differential(per, [rank])
    grown = diff[diff["added_s"] > 0].head(10)
    st.markdown(f"**Where rank {rank} spends more than its peers' median**")
    if grown.empty:
        st.caption(f"Rank {rank} spends no more time than its peers' median in any call path.")
    else:
        top = grown.iloc[0]
        st.markdown(f"Most added: `{top['function']}`, {top['added_s']:.1f} s more than its peers' median")
        st.dataframe(pd.DataFrame({"function": grown["function"], "added s": grown["added_s"].round(2),
                                   f"rank {rank} s": grown["target_s"].round(2),
                                   "peers' median s": grown["peers_median_s"].round(2), "call path": grown["path"]}),
                     hide_index=True, key=f"{key}_diff")
    mine = per[per["rank"] == rank]
    nodes = profiles.differential_nodes(per, [rank])
    added = dict(zip(nodes["node"], nodes["added_s"], strict=True))
    tree = flame.sampled_tree(mine["path"].where(mine["path"] != profiles.OTHER, ""), mine["seconds"] * 1e9)
    flame_chart.icicle_chart(flame.icicle(tree), "ms", added=added)
