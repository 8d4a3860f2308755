"""The icicle (flame graph) of a :func:`rankscope.dashboard.flame.icicle` layout on a page: width =
inclusive time, callees below their callers, largest first, drawn as SVG
(:func:`rankscope.dashboard.svg_charts.icicle_svg`). With ``added`` (node path -> seconds more than
the peers' median), nodes are coloured by it instead of by name: the call paths that grew stand out
in red."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from rankscope.dashboard import svg_charts


def icicle_chart(ice: pd.DataFrame, unit: str, empty: str = "Nothing to draw.",
                 added: dict[tuple[str, ...], float] | None = None) -> None:
    if ice.empty:
        st.caption(empty)
        return
    svg_charts.show(svg_charts.icicle_svg(ice, unit, added=added))
    colours = ("red: more time than the peers' median, blue: less; " if added is not None else "")
    st.caption(f"{len(ice) - 1} frames; width = inclusive time, callees below their callers, largest first; "
               f"{colours}hover a frame for its call path and time. Frames under 0.2 % of the total are hidden.")
