"""The dashboard's web server: Streamlit's ASGI app for app.py, with the base-URL hint
(base_url_hint.py) in every page's HTML, and the Job page's first queries started when the browser
asks for the page (prefetch.py).

Run with ``streamlit run dashboard/server.py`` (``rankscope serve`` does it for you).
"""

from pathlib import Path

import streamlit as st
from starlette.middleware import Middleware

from rankscope.dashboard.base_url_hint import BaseUrlHint
from rankscope.dashboard.nav import URL_PATHS
from rankscope.dashboard.prefetch import JobPagePrefetch

app = st.App(Path(__file__).with_name("app.py"),
             middleware=[Middleware(JobPagePrefetch), Middleware(BaseUrlHint, page_paths=URL_PATHS)])
