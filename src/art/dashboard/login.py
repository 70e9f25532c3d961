"""A browser's way into /dashboard on a keyed `art serve`: it cannot send `Authorization: Bearer`,
so a login form posts the key once and gets a cookie that stands in for the header, on
/dashboard paths only (`art.server.security.BearerAuth` asks `session_check`; /v1 and /art still
need the header).

The cookie holds `session_token(key)`, an HMAC of the key, never the key itself: a leaked cookie
opens the read-only dashboard but cannot be replayed as the API key, and it stops working
when the server's key changes. It is HttpOnly (no script reads it), SameSite=Strict (no other
site's page sends it, so no cross-site request rides on it) and scoped to Path=/dashboard; it
lasts until the browser closes. Logging out drops the browser's copy; the token itself stays valid
as long as the key does (there is no session store to revoke it from).
The form posts the key in the body: a key in the URL stays a 400 (`RefuseQueryCredentials`), and
`BodyLimit` bounds the body (`LOGIN_MAX_BYTES`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from art.dashboard import login_page

PREFIX = "/dashboard"
LOGIN_PATH = login_page.LOGIN_ACTION
LOGOUT_PATH = "/dashboard/logout"
OPEN_PATHS = frozenset({LOGIN_PATH, LOGOUT_PATH})
"""Reachable without a credential: the form must be postable by someone who has none yet."""
COOKIE = "art_dashboard"
LOGIN_MAX_BYTES = 4096
"""A login body is one short form field; `BodyLimit` answers 413 past this."""
_PAGES = frozenset({PREFIX, PREFIX + "/"})
"""The page a person opens: its 401 is the login form, every other path's stays JSON."""
_FORM_HEADERS = {
    "cache-control": "no-store",
    "www-authenticate": "Bearer",
    # No script, no framing, nothing fetched: the form can only post to this server.
    "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'",
}


def session_token(api_key: str) -> str:
    """The cookie's value: derived from the key, and revealing nothing of it."""
    return hmac.new(api_key.encode(), b"art-dashboard-session", hashlib.sha256).hexdigest()


def is_dashboard_path(path: str) -> bool:
    """`/dashboard` and what lies under it, never a mere prefix match (`/dashboardx`)."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def has_session(headers: list[tuple[bytes, bytes]], token: bytes) -> bool:
    """Whether the request's cookies hold `token` under `COOKIE` (compared in constant time)."""
    for name, value in headers:
        if name != b"cookie":
            continue
        for pair in value.split(b";"):
            cookie, _, given = pair.strip().partition(b"=")
            if cookie == COOKIE.encode() and hmac.compare_digest(given.strip(), token):
                return True
    return False


def wants_login_form(scope) -> bool:
    """A browser opening the page (GET of /dashboard, HTML accepted), not a script calling the API."""
    if scope["method"] not in ("GET", "HEAD") or scope["path"] not in _PAGES:
        return False
    accept = b",".join(v for k, v in scope["headers"] if k == b"accept")
    return b"text/html" in accept.lower()


def login_form(message: str | None = None) -> HTMLResponse:
    """The 401 that asks for the key (also an ASGI app, so `BearerAuth` can answer with it)."""
    return HTMLResponse(login_page.render(message), status_code=401, headers=_FORM_HEADERS)


def session_check(api_key: str) -> Callable[[dict[str, Any]], bool]:
    """`BearerAuth`'s `session` for a server keyed by `api_key`: a /dashboard request whose
    cookie holds the key's `session_token`."""
    token = session_token(api_key).encode()
    return lambda scope: is_dashboard_path(scope["path"]) and has_session(scope["headers"], token)


def login_form_for(scope) -> HTMLResponse | None:
    """`BearerAuth`'s `login_form`: the form for a browser opening the page, None for the rest."""
    return login_form() if wants_login_form(scope) else None


def login_router(api_key: str) -> APIRouter:
    """POST /dashboard/login (form field `key`) and POST /dashboard/logout, for a server keyed by
    `api_key`. The body is parsed with the standard library: a one-field form needs no
    multipart parser."""
    expected = api_key.encode()
    cookie_value = session_token(api_key)
    router = APIRouter(include_in_schema=False)

    @router.post(LOGIN_PATH)
    async def login(request: Request):
        form = parse_qs((await request.body()).decode("utf-8", errors="replace"))
        given = (form.get("key") or [""])[0]
        if not given:
            return login_form("wrong key: the form field `key` is missing or empty")
        if not hmac.compare_digest(given.encode(), expected):
            return login_form("wrong key")
        return _to_page(_cookie(cookie_value, secure=request.url.scheme == "https"))

    @router.get(LOGIN_PATH)
    async def login_bookmarked():
        """A GET (a bookmark, a typed URL): the page, which shows the form when needed."""
        return RedirectResponse(PREFIX + "/", status_code=303)

    @router.post(LOGOUT_PATH)
    async def logout(request: Request):
        return _to_page(_cookie("", secure=request.url.scheme == "https", max_age=0))

    return router


def _cookie(value: str, *, secure: bool, max_age: int | None = None) -> str:
    """A Set-Cookie value, written out so every attribute is visible here."""
    parts = [f"{COOKIE}={value}", f"Path={PREFIX}", "HttpOnly", "SameSite=Strict"]
    if max_age is not None:
        parts.append(f"Max-Age={max_age}")
    if secure:
        parts.append("Secure")
    return "; ".join(parts)


def _to_page(set_cookie: str) -> RedirectResponse:
    """303: the browser follows with a GET, so a reload does not post the form again."""
    return RedirectResponse(
        PREFIX + "/", status_code=303, headers={"set-cookie": set_cookie, "cache-control": "no-store"}
    )
