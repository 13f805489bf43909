"""Security for a localhost tool: SecurityMiddleware checks every request before a route sees it.

Host allow-list (403, against DNS rebinding), same-origin Origin on state-changing requests (403,
against CSRF), JSON-only bodies (415) of at most 64 KiB (413), an optional bearer token (401) that a
browser sets once through `/?token=...` (HttpOnly SameSite=Strict cookie), and nosniff / frame / CSP /
referrer headers on every response. deps.require_auth repeats the token check for the routes, so that
OpenAPI declares it.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import re
from http.cookies import SimpleCookie
from urllib.parse import parse_qs

from fastapi.responses import JSONResponse

MAX_BODY = 64 * 1024
CSP = ("default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'self'; "
       "frame-ancestors 'none'; form-action 'self'")
SECURITY_HEADERS = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
                    (b"content-security-policy", CSP.encode()), (b"referrer-policy", b"no-referrer")]
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
TOKEN_RE = re.compile(r"^[A-Za-z0-9._~+/=-]+$")


def is_loopback(host):
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# a Host header: a name, an IPv4 address or a bracketed IPv6 one, then an optional numeric port; nothing else
HOST_RE = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::[0-9]{1,5})?")


def _host_only(value):
    """'127.0.0.1:8000' -> '127.0.0.1', '[::1]:8000' -> '[::1]', lower-case; None unless the whole
    value is a host and an optional port ('127.0.0.1:8000.evil.example' is not)."""
    m = HOST_RE.fullmatch(value.strip().lower())
    return m[1] if m else None


class SecurityMiddleware:
    """Host (403), token (401), Origin (403), JSON-only (415) and size (413) checks; security headers."""

    def __init__(self, app, *, host, token, cookie_name, max_body=MAX_BODY):
        self.app, self.token, self.cookie_name, self.max_body = app, token, cookie_name, max_body
        bound = host.strip().lower()
        if ":" in bound and not bound.startswith("["):
            bound = f"[{bound}]"
        self.any_host = bound in ("0.0.0.0", "[::]", "")           # wildcard bind: the token guards it
        self.allowed_hosts = {"127.0.0.1", "localhost", "[::1]", bound}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        extra_headers = list(SECURITY_HEADERS)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + extra_headers)
            await send(message)

        headers = {}
        for k, v in scope.get("headers", []):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        method = scope["method"].upper()

        async def refuse(status, detail, **hdrs):
            await JSONResponse({"detail": detail}, status, headers=hdrs)(scope, receive, send_with_headers)

        host_header = headers.get("host", "")
        host = _host_only(host_header)
        if host is None or not (self.any_host or host in self.allowed_hosts):
            return await refuse(403, "host not allowed")
        if self.token:
            ok, from_query = self._authorized(headers, scope, method)
            if not ok:
                return await refuse(401, "missing or wrong token", **{"WWW-Authenticate": "Bearer"})
            scope = dict(scope)
            scope["anectypes.authorized"] = True
            if from_query:
                extra_headers.append((b"set-cookie", f"{self.cookie_name}={self.token}; HttpOnly; "
                                                     "SameSite=Strict; Path=/".encode()))
        if method in SAFE_METHODS:
            return await self.app(scope, receive, send_with_headers)
        origin = headers.get("origin")
        if origin is not None:
            own = host_header.strip().lower()
            if origin.strip().lower() not in (f"http://{own}", f"https://{own}"):
                return await refuse(403, "cross-origin request refused")
        ctype = headers.get("content-type")
        if ctype is not None and ctype.split(";")[0].strip().lower() != "application/json":
            return await refuse(415, "request bodies must be application/json")
        try:
            length = int(headers.get("content-length", "0") or 0)
        except ValueError:
            return await refuse(400, "bad content-length")
        if length > self.max_body:
            return await refuse(413, f"request body over {self.max_body} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return                                              # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return await refuse(413, f"request body over {self.max_body} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body and ctype is None:
            return await refuse(415, "request bodies must be application/json")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send_with_headers)

    def _authorized(self, headers, scope, method):
        """(authorized, through ?token=): Bearer header, the cookie, or ?token= on a GET."""
        want = self.token.encode()
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer " and hmac.compare_digest(auth[7:].strip().encode(), want):
            return True, False
        cookie = SimpleCookie()
        with contextlib.suppress(Exception):
            cookie.load(headers.get("cookie", ""))
        if self.cookie_name in cookie and hmac.compare_digest(cookie[self.cookie_name].value.encode(), want):
            return True, False
        if method in ("GET", "HEAD"):
            given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
            if given and hmac.compare_digest(given[-1].encode(), want):
                return True, True
        return False, False

