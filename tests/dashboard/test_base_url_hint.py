"""The base-URL hint: the script it puts in the app's HTML, and which responses it edits."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from rankscope.dashboard import nav
from rankscope.dashboard.base_url_hint import BaseUrlHint, hint_script, is_page_request, with_hint

HTML = b"<!DOCTYPE html><html><head><title>Streamlit</title></head><body></body></html>"


def served(path: str, body: bytes, content_type: bytes, method: str = "GET", **extra: Any) -> tuple[list, dict]:
    """Run a request through the middleware in front of an app answering ``body``: (messages sent,
    the scope the app saw)."""
    seen: dict[str, Any] = {}

    async def app(scope, receive, send):
        seen.update(scope)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]})
        half = len(body) // 2
        await send({"type": "http.response.body", "body": body[:half], "more_body": True})
        await send({"type": "http.response.body", "body": body[half:]})

    sent: list[dict[str, Any]] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request"}

    scope = {"type": "http", "method": method, "path": path, "headers": [(b"accept-encoding", b"gzip")], **extra}
    asyncio.run(BaseUrlHint(app, page_paths=["job", "sql"])(scope, receive, send))
    return sent, seen


def body_of(sent: list) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_page_gets_the_script_first_in_its_head_with_its_length():
    sent, seen = served("/job", HTML, b"text/html; charset=utf-8")
    body = body_of(sent)
    assert body.startswith(b"<!DOCTYPE html><html><head><script>") and body.endswith(b"</script><title>Streamlit</title></head><body></body></html>")
    assert dict(sent[0]["headers"])[b"content-length"] == str(len(body)).encode()
    assert (b"accept-encoding", b"gzip") not in seen["headers"]     # asked uncompressed, to be edited


def test_anything_else_passes_unchanged():
    for path, ctype, method in [("/static/js/index.js", b"application/javascript", "GET"),
                                ("/_stcore/health", b"text/plain", "GET"), ("/job", b"text/html", "HEAD"),
                                ("/favicon.png", b"image/png", "GET"), ("/job", b"application/json", "GET")]:
        sent, _ = served(path, b"<head>x</head>", ctype, method)
        assert body_of(sent) == b"<head>x</head>", path
        assert dict(sent[0]["headers"])[b"content-length"] == b"14"


def test_page_requests_are_gets_outside_streamlits_routes():
    assert is_page_request({"type": "http", "method": "GET", "path": "/job"})
    assert is_page_request({"type": "http", "method": "GET", "path": "/"})
    assert not is_page_request({"type": "websocket", "path": "/_stcore/stream"})
    assert not is_page_request({"type": "http", "method": "GET", "path": "/job/_stcore/health"})
    assert not is_page_request({"type": "http", "method": "POST", "path": "/job"})


def test_html_without_a_head_is_left_alone():
    assert with_hint(b"<html></html>", b"<script></script>") == b"<html></html>"


def test_the_script_knows_every_page_path_but_the_default_pages():
    script = hint_script(nav.URL_PATHS).decode()
    assert script.startswith("<script>") and script.endswith("</script>")
    listed = json.loads(re.search(r"if\((\[.*?\])\.includes", script).group(1))
    assert sorted(listed) == sorted(p.url_path for p in nav.PAGES if p.url_path)
    assert "BACKEND_BASE_URL:location.origin+p.slice(0,i+1)" in script
