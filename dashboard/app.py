"""rankscope dashboard entry point: page config and navigation only; the pages live in pages/.

Run with ``streamlit run dashboard/app.py`` (``rankscope serve`` does it for you).
"""

import streamlit as st

from dashboard.login import signed_in

st.set_page_config(page_title="rankscope", page_icon=":material/monitoring:", layout="wide")
if not signed_in():
    st.stop()

pages = [
    st.Page("pages/fleet.py", title="Fleet overview", icon=":material/dns:", default=True),
    st.Page("pages/job.py", title="Job", icon=":material/timeline:", url_path="job"),
    st.Page("pages/alerts.py", title="Alerts", icon=":material/notifications:", url_path="alerts"),
    st.Page("pages/host.py", title="Host", icon=":material/memory:", url_path="host"),
    st.Page("pages/traces.py", title="Trace windows", icon=":material/troubleshoot:", url_path="traces"),
    st.Page("pages/reports.py", title="Reports", icon=":material/summarize:", url_path="reports"),
    st.Page("pages/sql.py", title="SQL console", icon=":material/terminal:", url_path="sql"),
]
st.navigation(pages).run()
