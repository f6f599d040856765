"""The dashboard's guards, each a plain ASGI middleware testable alone.

- ``SecurityHeaders``: a strict CSP (scripts and styles from this origin only, no inline code,
  no framing, forms submit to this origin only: the one form is the GET job search) and the usual hardening headers, on every response; ``Cache-Control: no-store``
  on every response but static files (errors included: a cached 503 or 401 would outlive
  its cause, and figures must never come from a cache).
- ``ReadOnlyMethods``: GET and HEAD only; anything else is 405 before routing or auth, which
  removes most CSRF risk: there is nothing to forge.
- ``BasicAuth``: optional; credentials compared in constant time; the health probes
  (``/health``, ``/healthz``, ``/readyz``) stay open.
"""

from __future__ import annotations

import base64
import binascii
import hmac

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; manifest-src 'self'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Permissions-Policy": "camera=(), microphone=(), geolocation=(), payment=()",
}
ALLOWED_METHODS = ("GET", "HEAD")
CACHEABLE_PREFIX = "/static/"
#: Probes (a load balancer's, Kubernetes') answer without credentials; they reveal nothing.
OPEN_PATHS = ("/health", "/healthz", "/readyz")


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        cacheable = str(scope["path"]).startswith(CACHEABLE_PREFIX)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    headers[name] = value
                if not cacheable:
                    headers["Cache-Control"] = "no-store"
            await send(message)

        await self.app(scope, receive, send_with_headers)


class ReadOnlyMethods:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in ALLOWED_METHODS:
            response = PlainTextResponse(
                "read-only dashboard: only GET and HEAD", status_code=405,
                headers={"Allow": ", ".join(ALLOWED_METHODS)},
            )  # fmt: skip
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def credentials_match(header: str | None, username: str, password: str) -> bool:
    """Constant-time check of an ``Authorization: Basic`` header (both fields always compared)."""
    if not header or not header.lower().startswith("basic "):
        return False
    try:
        decoded = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return False
    given_user, sep, given_password = decoded.partition(":")
    user_ok = hmac.compare_digest(given_user.encode(), username.encode())
    password_ok = hmac.compare_digest(given_password.encode(), password.encode())
    return bool(sep) and user_ok and password_ok


class BasicAuth:
    def __init__(self, app: ASGIApp, username: str, password: str) -> None:
        self.app = app
        self.username = username
        self.password = password

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization")
        if not credentials_match(header, self.username, self.password):
            response = PlainTextResponse(
                "authentication required", status_code=401,
                headers={"WWW-Authenticate": 'Basic realm="pgqueue", charset="UTF-8"'},
            )  # fmt: skip
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
