"""The dashboard's password gate, shown before any page when ``dashboard_password`` is set.

``rankscope serve`` refuses to bind a non-loopback ``dashboard_host`` without a password
(storage/serve.py ``check_bind``); this gate is what the password protects. The navigation runs
only after the visitor's session has passed it, so no page, query or control runs before. A wrong
password waits a second before answering, which bounds guessing per session.

A correct password also stores a signed cookie (``session_cookie.py``) that lasts
``dashboard_session_h`` hours: a reload or a new tab of the same browser sends it and skips the form.
Streamlit has no server-side way to set a cookie, so a script in the page writes ``document.cookie``;
each run reads the cookies the browser sent when its session connected (``st.context.cookies``).
"Sign out" in the sidebar deletes the cookie and ends this session's sign-in.
"""

from __future__ import annotations

import hmac
import time

import streamlit as st

from rankscope.config import ConfigError, Settings
from rankscope.dashboard import session_cookie

SESSION_KEY = "rankscope_signed_in"     # the session's sign-in expiry (unix seconds)
SIGNED_OUT_KEY = "rankscope_signed_out"  # this session signed out: its connection's cookie no longer counts
SCRIPT_KEY = "rankscope_cookie_script"   # a cookie script to put in the page on the next run
WRONG_PASSWORD_WAIT_S = 1.0


def password_ok(given: str, expected: str) -> bool:
    """Constant-time comparison of two passwords (UTF-8)."""
    return hmac.compare_digest(given.encode(), expected.encode())


def signed_in() -> bool:
    """True when no password is set, this session has entered it, or the browser sent a valid sign-in
    cookie; otherwise draw the sign-in form and return False (the caller stops the script)."""
    try:
        settings = Settings.from_env()
    except ConfigError as e:
        st.error(f"rankscope configuration error: {e}")
        return False
    expected = settings.dashboard_password
    if not expected:
        return True
    state = st.session_state
    script = state.pop(SCRIPT_KEY, None)  # put in the page once; it runs when the browser draws it
    now = time.time()
    key = session_cookie.dashboard_key(expected, settings.dashboard_secret, settings.data_dir)
    name = session_cookie.cookie_name(settings.dashboard_port)
    if not state.get(SESSION_KEY, 0) > now and not state.get(SIGNED_OUT_KEY):
        state[SESSION_KEY] = session_cookie.verify(key, st.context.cookies.get(name), now) or 0
    if state.get(SESSION_KEY, 0) > now:
        st.sidebar.button("Sign out", key="rankscope_sign_out", on_click=_sign_out, args=(name,))
        if script:  # last in the sidebar: its empty slot moves nothing
            st.sidebar.html(script, unsafe_allow_javascript=True)
        return True
    if script:
        st.html(script, unsafe_allow_javascript=True)
    st.title("rankscope")
    with st.form("rankscope_sign_in"):
        given = st.text_input("Password", type="password")
        submitted = st.form_submit_button("Sign in")
    if submitted:
        if password_ok(given, expected):
            expiry = int(now + settings.dashboard_session_h * 3600)
            state[SESSION_KEY] = expiry
            state.pop(SIGNED_OUT_KEY, None)
            state[SCRIPT_KEY] = session_cookie.set_cookie_js(name, session_cookie.sign(key, expiry), expiry - int(now))
            st.rerun()
        time.sleep(WRONG_PASSWORD_WAIT_S)
        st.error("Wrong password.")
    return False


def _sign_out(name: str) -> None:
    st.session_state[SESSION_KEY] = 0
    st.session_state[SIGNED_OUT_KEY] = True
    st.session_state[SCRIPT_KEY] = session_cookie.clear_cookie_js(name)
