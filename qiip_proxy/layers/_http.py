"""HTTP behaviours around the daemon's routes, applied to the whole ASGI app from outside: the `Host` check,
`HEAD` on every `GET` route, and CORS for web pages on other origins.

`serving_app` (`_app`) stacks them so the inference fast path (`ProxyRoutes`) pays for none it does not need:

    AllowedHosts              a `Host` the daemon is not reached by gets 421 (one set lookup for a known value)
      CORSMiddleware          only with `server.cors_allow_origins` set: preflights, and CORS headers on
        ProxyRoutes           every answer, the fast path's plain and streamed ones included
          HeadAsGet           `HEAD` only; every other method passes through untouched
            FastAPI

The fast path serves `POST` only, so `HEAD` never reaches it; a `HEAD` on an inference path answers like a
`GET` there: 405.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qiip_proxy._errors import RequestRefused, send_error
from qiip_proxy._scope import request_id_for

__all__ = [
    "CORS_ALLOW_HEADERS",
    "CORS_ALLOW_METHODS",
    "CORS_EXPOSE_HEADERS",
    "AllowedHosts",
    "HeadAsGet",
    "HostCheck",
    "with_allowed_hosts",
    "with_cors",
]

CORS_ALLOW_METHODS = ("GET", "HEAD", "POST", "DELETE")
"""Methods a preflight allows: the ones the client and admin APIs use."""

CORS_ALLOW_HEADERS = (
    "Authorization",
    "Content-Type",
    "X-Request-Id",
    "traceparent",
    "tracestate",
    # What the openai JavaScript library adds to every request; a browser refuses the request unless the
    # preflight allows each one (the same list as Ollama's, ollama/ollama server/routes.go).
    "OpenAI-Beta",
    "X-Stainless-Arch",
    "X-Stainless-Async",
    "X-Stainless-Custom-Poll-Interval",
    "X-Stainless-Helper-Method",
    "X-Stainless-Lang",
    "X-Stainless-OS",
    "X-Stainless-Package-Version",
    "X-Stainless-Poll-Helper",
    "X-Stainless-Retry-Count",
    "X-Stainless-Runtime",
    "X-Stainless-Runtime-Version",
    "X-Stainless-Timeout",
)
"""Request headers a preflight allows, beyond the CORS-safelisted ones: the ones the daemon reads or forwards
(`Authorization` for invoke tokens and the admin API, `Content-Type: application/json`, the request id and
trace context), and the ones the openai JavaScript library sends."""

CORS_EXPOSE_HEADERS = ("X-Request-Id", "X-QIIP-Node", "X-QIIP-Attempts", "X-QIIP-Failover", "Retry-After")
"""Response headers a page's script may read, beyond the CORS-safelisted ones (Fetch standard, "CORS-safelisted
response-header name")."""


def with_cors(app: ASGIApp, origins: Sequence[str]) -> ASGIApp:
    """`app` behind Starlette's `CORSMiddleware` for `origins` (the Fetch standard's CORS protocol).

    A preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) is answered here: 200 with the
    allowed methods and headers for an allowed origin, else 400 without `Access-Control-Allow-Origin`, which the
    browser reports as a CORS failure. Every other answer gets `Access-Control-Allow-Origin` (the origin itself,
    or `*` when `origins` holds `*`) when its request came from an allowed origin, and `Vary: Origin`. Browser
    credentials (cookies, a cached HTTP Basic login) are never allowed: a page must send its own
    `Authorization`, so an allowed page cannot act with an operator's stored admin login.

    Args:
        app: the app to wrap (the whole daemon, fast path included).
        origins: `server.cors_allow_origins`, already checked; not empty.

    Returns:
        The wrapped app.
    """
    return CORSMiddleware(
        app,
        allow_origins=list(origins),
        allow_methods=CORS_ALLOW_METHODS,
        allow_headers=CORS_ALLOW_HEADERS,
        allow_credentials=False,
        expose_headers=CORS_EXPOSE_HEADERS,
    )


class HeadAsGet:
    """ASGI middleware: answer `HEAD` as `GET` without the body (RFC 9110 §9.3.2), on every route.

    FastAPI's routes answer only the methods they declare, so a `HEAD` on a `GET` route would be a 405. Here
    the app serves a `HEAD` as the `GET` it stands for; the client gets that answer's status and headers
    (`Content-Length` and `Content-Type` included), and the response ends right after them. Ending it there
    also ends an answer that never ends by itself (`/admin/events`): the server then reports the client gone to
    the app (ASGI HTTP spec, `http.disconnect` "if receive is called after a response has been sent"), which
    stops the stream. The app's body messages are dropped.

    Args:
        app: the app to wrap.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        ended = False

        async def send_head(message: Message) -> None:
            nonlocal ended
            if ended:
                return
            await send(message)
            if message["type"] == "http.response.start":
                ended = True
                await send({"type": "http.response.body", "body": b""})

        # A copy: the server keeps its own scope saying HEAD, so it still sends no body whatever it is given.
        await self.app({**scope, "method": "GET"}, receive, send_head)


def with_allowed_hosts(app: ASGIApp, *, allowed_hosts: Sequence[str], bind_host: str) -> ASGIApp:
    """`app` behind the `Host` check (`AllowedHosts`), or `app` itself when `allowed_hosts` holds `*`.

    Args:
        app: the app to wrap (the whole daemon, fast path included).
        allowed_hosts: `server.allowed_hosts`, already checked (lower case, no port).
        bind_host: `server.host`, the address or name the daemon binds.
    """
    if "*" in allowed_hosts:
        return app
    return AllowedHosts(app, allowed_hosts=allowed_hosts, bind_host=bind_host)


class HostCheck:
    """Whether a request's `Host` names this daemon (`AllowedHosts` explains the rule), and the refusal when not.

    Args:
        allowed_hosts: `server.allowed_hosts` (lower case, no port; `*` is for `with_allowed_hosts`).
        bind_host: `server.host`.
    """

    _KNOWN_MAX = 256
    """`Host` values remembered as allowed, so the usual request costs one set lookup."""

    def __init__(self, *, allowed_hosts: Sequence[str], bind_host: str) -> None:
        self.names = {"localhost", bind_host.lower().rstrip(".")}
        suffixes = [".localhost"]
        for entry in allowed_hosts:
            if entry.startswith("*."):
                suffixes.append(entry[1:])
            else:
                self.names.add(entry)
        self.suffixes = tuple(suffixes)
        self._known: set[bytes] = set()

    def passes(self, scope: Scope) -> bool:
        """Whether the request of `scope` may be served: no `Host` (HTTP/1.0), or one that names this daemon."""
        value = _host_header(scope)
        if value is None or value in self._known:
            return True
        if not self.allows(value):
            return False
        if len(self._known) < self._KNOWN_MAX:
            self._known.add(value)
        return True

    async def refuse(self, scope: Scope, send: Send) -> None:
        """Answer a request that does not pass: 421 with OpenAI error JSON, code `host_not_allowed`."""
        refused = RequestRefused(
            421,
            "This daemon is not reached by that host name (the Host header); an operator can allow "
            "it with server.allowed_hosts.",
            "host_not_allowed",
        )
        await send_error(send, refused, request_id_for(scope))

    def allows(self, value: bytes) -> bool:
        """Whether a `Host` header value (`name[:port]`, `[v6]:port`, an IPv4 literal) names this daemon."""
        text = value.decode("latin-1").strip().lower()
        if text.startswith("["):
            name = text[1 : text.find("]")] if "]" in text else text
        else:
            name = text.rsplit(":", 1)[0] if text.count(":") == 1 else text
        name = name.rstrip(".")
        if name in self.names or name.endswith(self.suffixes):
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


class AllowedHosts:
    """ASGI middleware: a request whose `Host` names something other than this daemon gets 421 Misdirected
    Request (RFC 9110 §15.5.20) with OpenAI error JSON, code `host_not_allowed`.

    A web page the operator opens can make the browser send requests to a loopback daemon under the page's own
    name (DNS rebinding: the name first resolves to the attacker's server, then to 127.0.0.1), and the browser
    then lets the page read the answers as its own. Such requests carry that name in `Host`. Allowed are the
    names the daemon is reached by: `localhost` and `*.localhost` (RFC 6761), any IP literal (a page whose origin
    is an IP address is served by that address, never by a rebinding), the bound name, and `allowed_hosts`
    (exact names, or `*.suffix` for any name under it). A request without `Host` (HTTP/1.0) passes.

    Args:
        app: the app to wrap.
        allowed_hosts: `server.allowed_hosts` (lower case, no port; `*` is for `with_allowed_hosts`).
        bind_host: `server.host`.
    """

    def __init__(self, app: ASGIApp, *, allowed_hosts: Sequence[str], bind_host: str) -> None:
        self.app = app
        self.check = HostCheck(allowed_hosts=allowed_hosts, bind_host=bind_host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.check.passes(scope):
            await self.check.refuse(scope, send)
            return
        await self.app(scope, receive, send)

    def allows(self, value: bytes) -> bool:
        """Whether a `Host` header value (`name[:port]`, `[v6]:port`, an IPv4 literal) names this daemon."""
        return self.check.allows(value)


def _host_header(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"host":
            return bytes(value)
    return None
