"""rankscope dashboard entry point: page config and navigation only; the pages live in pages/.

Run with ``streamlit run dashboard/app.py`` (``rankscope serve`` does it for you).
"""

import streamlit as st

st.set_page_config(page_title="rankscope", page_icon=":material/monitoring:", layout="wide")

pages = [
    st.Page("pages/fleet.py", title="Fleet overview", icon=":material/dns:", default=True),
    st.Page("pages/job.py", title="Job", icon=":material/timeline:", url_path="job"),
    st.Page("pages/alerts.py", title="Alerts", icon=":material/notifications:", url_path="alerts"),
]
st.navigation(pages).run()
