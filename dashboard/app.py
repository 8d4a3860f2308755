"""rankscope dashboard entry point: page config and navigation only; the pages live in views/ and
are listed in nav.py.

Not in pages/: Streamlit finds a folder of that name next to the script by itself, and a visitor
whose first request is a page URL then gets that folder's files as the navigation.

server.py serves this script (``streamlit run dashboard/server.py``; ``rankscope serve`` does it
for you).
"""

import streamlit as st

from rankscope.dashboard.login import signed_in
from rankscope.dashboard.nav import PAGES

st.set_page_config(page_title="rankscope", page_icon=":material/monitoring:", layout="wide")
if not signed_in():
    st.stop()

pages = [st.Page(p.script, title=p.title, icon=p.icon, url_path=p.url_path or None, default=not p.url_path)
         for p in PAGES]
st.navigation(pages).run()
