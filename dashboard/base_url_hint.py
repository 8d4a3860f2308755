"""Tells the page where the app's base URL is, so a page URL connects on the first try.

Streamlit's page does not know the app's base URL. Opened at a page's URL (``/job?job=J``), it
tries that path as the base first: ``/job/_stcore/health`` answers 404, and only after a retry
delay does it try ``/``. That costs ~0.13 s of every visit to a page other than the default one.

The page reads its base URL from ``window.__streamlit.BACKEND_BASE_URL`` when that is set before
its scripts run. :class:`BaseUrlHint`, an ASGI middleware, puts :func:`hint_script` at the top of
the HTML Streamlit serves. The script runs in the browser: when the URL's last path segment is one
of the app's page paths, it strips that segment, so the hint holds behind a proxy that serves the
app under a prefix. At any other URL it sets nothing, and Streamlit guesses as before.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Path parts under which Streamlit serves anything but the app's HTML.
NOT_PAGES = ("/_stcore/", "/static/", "/media/", "/component/", "/app/static/")


def hint_script(page_paths: Iterable[str]) -> bytes:
    """The ``<script>`` that sets ``window.__streamlit.BACKEND_BASE_URL`` from the page's URL."""
    pages = json.dumps(sorted(set(page_paths)))
    js = ("(()=>{const p=location.pathname.replace(/\\/+$/,\"\"),i=p.lastIndexOf(\"/\");"
          f"if({pages}.includes(p.slice(i+1)))"
          "window.__streamlit={...window.__streamlit,BACKEND_BASE_URL:location.origin+p.slice(0,i+1)};})()")
    return f"<script>{js}</script>".encode()


def is_page_request(scope: Scope) -> bool:
    """A GET of something that may be the app's HTML: not under Streamlit's own routes, no file name."""
    path = str(scope.get("path", ""))
    return (scope.get("type") == "http" and scope.get("method") == "GET"
            and not any(part in path for part in NOT_PAGES) and "." not in path.rsplit("/", 1)[-1])


def with_hint(html: bytes, script: bytes) -> bytes:
    """``html`` with ``script`` first in its ``<head>`` (unchanged when it has none)."""
    head = html.find(b"<head>")
    if head < 0:
        return html
    at = head + len(b"<head>")
    return html[:at] + script + html[at:]


class BaseUrlHint:
    """ASGI middleware: adds :func:`hint_script` to the HTML responses of page requests."""

    def __init__(self, app: ASGIApp, page_paths: Iterable[str]) -> None:
        self.app = app
        self.script = hint_script(page_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not is_page_request(scope):
            await self.app(scope, receive, send)
            return
        # The HTML is ~2 KB: ask for it uncompressed, so that it can be edited.
        scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", []) if k != b"accept-encoding"]}
        start: Message = {}
        chunks: list[bytes] = []

        async def edit(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                if not headers.get(b"content-type", b"").startswith(b"text/html") or b"content-encoding" in headers:
                    await send(message)
                    return
                start.update(message)
                return
            if message["type"] != "http.response.body" or not start:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = with_hint(b"".join(chunks), self.script)
            sized = [(k, str(len(body)).encode() if k == b"content-length" else v) for k, v in start.get("headers", [])]
            await send({**start, "headers": sized})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, edit)
