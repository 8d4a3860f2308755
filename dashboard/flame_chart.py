"""The icicle (flame graph) chart of a :func:`rankscope.dashboard.flame.icicle` layout, as Altair
draws it: width = inclusive time, callees below their callers, largest first. With ``added`` (node
path -> seconds more than the peers' median), nodes are coloured by it instead of by name: the
call paths that grew stand out in red."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st


def icicle_chart(ice: pd.DataFrame, unit: str, empty: str = "Nothing to draw.",
                 added: dict[tuple[str, ...], float] | None = None) -> None:
    if ice.empty:
        st.caption(empty)
        return
    total = float(ice["x1"].max())
    depth = int(ice["depth"].max()) + 1
    data = ice.assign(frames=ice["path"].map(lambda p: " → ".join(p[1:]) or "all"), y1=ice["depth"] + 1,
                      ymid=ice["depth"] + 0.5)
    tooltip = [alt.Tooltip("frames:N", title="call path"), alt.Tooltip("total_ms:Q", title=f"total {unit}"),
               alt.Tooltip("self_ms:Q", title=f"self {unit}"), alt.Tooltip("share:Q", format=".1%")]
    if added is not None:
        data["added_s"] = data["path"].map(lambda p: round(added.get(tuple(p[1:]), 0.0), 3))
        color = alt.Color("added_s:Q", title="s more than peers", scale=alt.Scale(scheme="redblue", reverse=True,
                                                                                 domainMid=0))
        tooltip.append(alt.Tooltip("added_s:Q", title="s more than the peers' median"))
    else:
        color = alt.Color("name:N", legend=None, scale=alt.Scale(scheme="tableau20"))
        tooltip.append(alt.Tooltip("calls:Q"))
    data = data.drop(columns=["path"])
    y = alt.Scale(domain=[0, depth], reverse=True)
    base = alt.Chart(data).encode(x=alt.X("x0:Q", title=unit, scale=alt.Scale(domain=[0, total], nice=False)))
    rect = base.mark_rect(stroke="white", strokeWidth=1).encode(
        x2="x1:Q", y=alt.Y("depth:Q", scale=y, axis=None), y2="y1:Q", color=color, tooltip=tooltip)
    text = base.mark_text(align="left", baseline="middle", dx=3, fontSize=11, color="black").encode(
        y=alt.Y("ymid:Q", scale=y, axis=None), text="label:N")
    st.altair_chart(alt.layer(rect, text).properties(height=30 * depth + 20), width="stretch")
    st.caption(f"{len(ice) - 1} frames; width = inclusive time, callees below their callers, largest first. "
               "Frames under 0.2 % of the total are hidden.")
