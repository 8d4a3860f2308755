"""rankscope dashboard entry point: page config and navigation only; the pages live in views/.

Not in pages/: Streamlit finds a folder of that name next to the script by itself, and a visitor
whose first request is a page URL then gets that folder's files as the navigation.

Run with ``streamlit run dashboard/app.py`` (``rankscope serve`` does it for you).
"""

import streamlit as st

from rankscope.dashboard.login import signed_in

st.set_page_config(page_title="rankscope", page_icon=":material/monitoring:", layout="wide")
if not signed_in():
    st.stop()

pages = [
    st.Page("views/fleet.py", title="Fleet overview", icon=":material/dns:", default=True),
    st.Page("views/job.py", title="Job", icon=":material/timeline:", url_path="job"),
    st.Page("views/alerts.py", title="Alerts", icon=":material/notifications:", url_path="alerts"),
    st.Page("views/host.py", title="Host", icon=":material/memory:", url_path="host"),
    st.Page("views/traces.py", title="Trace windows", icon=":material/troubleshoot:", url_path="traces"),
    st.Page("views/reports.py", title="Reports", icon=":material/summarize:", url_path="reports"),
    st.Page("views/sql.py", title="SQL console", icon=":material/terminal:", url_path="sql"),
]
st.navigation(pages).run()
