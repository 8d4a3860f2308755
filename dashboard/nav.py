"""The dashboard's pages: script, title, icon and URL path. app.py builds its navigation from them;
the web server (server.py) needs their URL paths to tell a page's URL from the app's base URL."""

from __future__ import annotations

from typing import NamedTuple


class PageSpec(NamedTuple):
    script: str       # relative to dashboard/
    title: str
    icon: str
    url_path: str     # "" for the default page, served at the app's base URL


PAGES: tuple[PageSpec, ...] = (
    PageSpec("views/fleet.py", "Fleet overview", ":material/dns:", ""),
    PageSpec("views/job.py", "Job", ":material/timeline:", "job"),
    PageSpec("views/alerts.py", "Alerts", ":material/notifications:", "alerts"),
    PageSpec("views/host.py", "Host", ":material/memory:", "host"),
    PageSpec("views/traces.py", "Trace windows", ":material/troubleshoot:", "traces"),
    PageSpec("views/reports.py", "Reports", ":material/summarize:", "reports"),
    PageSpec("views/sql.py", "SQL console", ":material/terminal:", "sql"),
)

#: The URL path of every page but the default one.
URL_PATHS: tuple[str, ...] = tuple(p.url_path for p in PAGES if p.url_path)
