"""Authentication before work: the admin API's credentials and body size are checked from the headers,
before a byte of the body is read, and peers that keep failing are throttled.

`AdminGate` stands in front of FastAPI for `/admin/*`: FastAPI reads and parses a route's JSON body before
it runs the route's dependencies, so without the gate a client without credentials could make the daemon
read and parse any body. The gate answers, without reading the body:

- 429 with `Retry-After` to a peer over its failure budget (`AuthThrottle`);
- 401 to a request without the admin credentials (HTTP Basic, compared in constant time), logged with the
  peer's address and never the secret, counted in `qiip_auth_failures_total{api="admin"}`;
- 413 to a body over `admin.max_body_bytes` by its `Content-Length`, and 411 to a body of unknown size.

The client API's invoke tokens go through the same throttle and counter (`qiip_proxy._parse`).
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from qiip_proxy._errors import RequestRefused, describe_error

__all__ = ["AdminGate", "AuthThrottle", "header", "peer_of", "too_many_failures"]

logger = logging.getLogger("qiip.auth")


def peer_of(scope: Scope) -> str:
    """The client's address, as the server saw it (`unknown` for a Unix socket or a test client)."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


class AuthThrottle:
    """Failed authentications per peer address, over a sliding window: past `burst` failures within
    `window_s`, the peer's requests are refused until its oldest failure leaves the window.

    Args:
        burst: failures a peer may have within `window_s` before it is refused.
        window_s: the window, in seconds.
        max_peers: peers remembered at most (the least recently failed are forgotten first).
    """

    def __init__(self, *, burst: int = 10, window_s: float = 60.0, max_peers: int = 10_000) -> None:
        self.burst = burst
        self.window_s = window_s
        self.max_peers = max_peers
        self._failures: OrderedDict[str, list[float]] = OrderedDict()
        self.recorded: list[str] | None = None
        """With several serving processes (`server.workers`): the peers of the failures `failed` recorded since
        the last `take_recorded`, for the other processes to `learn`; None (the default): not kept."""

    def retry_after_s(self, peer: str) -> float | None:
        """Seconds until `peer` may try again, or None when it may now."""
        failures = self._failures.get(peer)
        if failures is None:
            return None
        now = time.monotonic()
        while failures and failures[0] <= now - self.window_s:
            failures.pop(0)
        if not failures:
            del self._failures[peer]
            return None
        if len(failures) < self.burst:
            return None
        return failures[-self.burst] + self.window_s - now

    def failed(self, peer: str) -> None:
        """Record one failed authentication from `peer`."""
        if self.recorded is not None:
            self.recorded.append(peer)
        self.learn(peer)

    def learn(self, peer: str) -> None:
        """Record one failed authentication from `peer` that another serving process saw (`failed` without
        keeping it for the others)."""
        failures = self._failures.pop(peer, None) or []
        failures.append(time.monotonic())
        del failures[: -self.burst]
        self._failures[peer] = failures
        while len(self._failures) > self.max_peers:
            self._failures.popitem(last=False)

    def take_recorded(self) -> list[str]:
        """The peers `failed` recorded since the last call (empty when not kept)."""
        recorded = self.recorded
        if not recorded:
            return []
        self.recorded = []
        return recorded


def too_many_failures(retry_after_s: float) -> RequestRefused:
    """The 429 refusal of a throttled peer, with `Retry-After` in whole seconds."""
    seconds = max(1, math.ceil(retry_after_s))
    return RequestRefused(
        429,
        f"Too many failed authentications from this address; retry in {seconds} s.",
        "too_many_auth_failures",
        type="rate_limit_error",
        headers={"Retry-After": str(seconds)},
    )


class AdminGate:
    """ASGI middleware: `/admin/*` requests are authenticated and their body size checked from the headers.

    Args:
        app: the app behind (FastAPI).
        username: the admin user name.
        password: the admin password.
        max_body_bytes: the largest admin request body.
        throttle: failed authentications per peer.
        on_failure: called with `"admin"` for each failed authentication (the metrics counter).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        username: str,
        password: str,
        max_body_bytes: int,
        throttle: AuthThrottle,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.app = app
        self._expected = (username.encode(), password.encode())
        self.max_body_bytes = max_body_bytes
        self.throttle = throttle
        self._on_failure = on_failure

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/admin"):
            await self.app(scope, receive, send)
            return
        peer = peer_of(scope)
        wait_s = self.throttle.retry_after_s(peer)
        if wait_s is not None:
            await _refuse(send, too_many_failures(wait_s))
            return
        if not self._authenticated(scope):
            self.throttle.failed(peer)
            if self._on_failure is not None:
                self._on_failure("admin")
            logger.warning("admin authentication failed from %s on %s %s", peer, scope["method"], scope["path"])
            given = header(scope, b"authorization") is not None
            await _refuse(send, _REFUSED if given else _UNAUTHORIZED)
            return
        declared = header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await _refuse(
                send,
                RequestRefused(
                    413,
                    f"Admin request bodies are limited to {self.max_body_bytes} bytes (admin.max_body_bytes).",
                    "request_too_large",
                ),
            )
            return
        if declared is None and header(scope, b"transfer-encoding") is not None:
            # A body of unknown size: refused before it is read (RFC 9110 §15.5.12).
            await _refuse(send, _LENGTH_REQUIRED)
            return
        await self.app(scope, receive, send)

    def _authenticated(self, scope: Scope) -> bool:
        given_user, given_password = b"", b""
        value = header(scope, b"authorization")
        if value is not None and value[:6].lower() == b"basic ":
            try:
                decoded = base64.b64decode(value[6:].strip(), validate=True)
            except (binascii.Error, ValueError):
                decoded = b""
            given_user, _, given_password = decoded.partition(b":")
        expected_user, expected_password = self._expected
        # Both comparisons always run, so timing says nothing about which part was wrong.
        user_ok = secrets.compare_digest(given_user, expected_user)
        password_ok = secrets.compare_digest(given_password, expected_password)
        return user_ok and password_ok and bool(expected_user)


_UNAUTHORIZED = RequestRefused(
    401,
    "Admin credentials are required (HTTP Basic).",
    "unauthorized",
    type="authentication_error",
    headers={"WWW-Authenticate": 'Basic realm="qiip-admin", charset="UTF-8"'},
)
_REFUSED = RequestRefused(
    401,
    "The admin credentials were refused: wrong username or password (HTTP Basic).",
    "unauthorized",
    type="authentication_error",
    headers={"WWW-Authenticate": 'Basic realm="qiip-admin", charset="UTF-8"'},
)
_LENGTH_REQUIRED = RequestRefused(411, "Admin requests with a body must declare its Content-Length.", "length_required")


async def _refuse(send: Send, refusal: RequestRefused) -> None:
    """Answer a request the gate refuses, through the daemon's one error mapping (`describe_error`)."""
    status, body, headers = describe_error(refusal)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(name.lower().encode(), value.encode()) for name, value in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def header(scope: Scope, name: bytes) -> bytes | None:
    """The value of request header `name` (lower-case bytes, as ASGI gives names), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None
