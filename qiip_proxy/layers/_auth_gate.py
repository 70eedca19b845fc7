"""Authentication before work: the admin API's credentials and body size are checked from the headers,
before a byte of the body is read, and peers that keep failing are throttled.

`AdminGate` stands in front of FastAPI for `/admin/*`: FastAPI reads and parses a route's JSON body before
it runs the route's dependencies, so without the gate a client without credentials could make the daemon
read and parse any body. The gate answers, without reading the body:

- 429 with `Retry-After` to a peer over its failure budget (`AuthThrottle`, the admin API's own);
- 401 to a request without the admin credentials (HTTP Basic, compared in constant time); credentials presented
  and wrong are logged with the peer's address and never the secret, counted in
  `qiip_auth_failures_total{api="admin"}` and throttled, while a request without any is refused uncounted;
- 413 to a body over `admin.max_body_bytes` (a backup's restore: `admin.max_restore_bytes`) by its
  `Content-Length`, and 411 to a body of unknown size.

The client API's invoke tokens have a throttle of their own and the same counter (`qiip_proxy._parse`), so
guessing one credential never locks the other out. HTTP Basic credentials are decoded once, as UTF-8 (RFC 7617's
`charset="UTF-8"`, which the challenge announces), by `basic_credentials`, here and in the admin routes.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import secrets
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from qiip_core._errors import safe_text
from qiip_core.auth import AuthThrottle
from qiip_proxy._errors import RequestRefused, body_too_large, describe_error
from qiip_proxy._scope import admin_body_limit, header, logged_path, peer_of

__all__ = [
    "AdminGate",
    "AuthThrottle",
    "admin_credentials_ok",
    "admin_unauthorized",
    "basic_credentials",
    "too_many_failures",
]

logger = logging.getLogger("qiip.auth")


def basic_credentials(value: bytes | None) -> tuple[bytes, bytes] | None:
    """The user name and password of an HTTP Basic `Authorization` value, as UTF-8 bytes (RFC 7617 §2.1, the
    `charset="UTF-8"` every challenge of the daemon announces), or None when `value` is missing, is another
    scheme, or is not base64 of valid UTF-8 with a colon."""
    if value is None or value[:6].lower() != b"basic ":
        return None
    try:
        decoded = base64.b64decode(value[6:].strip(), validate=True)
        decoded.decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    user, colon, password = decoded.partition(b":")
    return (user, password) if colon else None


def admin_credentials_ok(given: tuple[bytes, bytes] | None, expected: tuple[bytes, bytes]) -> bool:
    """Whether HTTP Basic credentials are the admin's: the one check of the admin gate and the admin routes.

    Args:
        given: the user name and password presented, as UTF-8 bytes (`basic_credentials`); None: none.
        expected: `admin.username` and `admin.password`, as UTF-8 bytes.

    Returns:
        True when both match and an admin user name is configured (with none, nothing is accepted).
    """
    given_user, given_password = given or (b"", b"")
    expected_user, expected_password = expected
    # Both comparisons always run, so timing says nothing about which part was wrong.
    user_ok = secrets.compare_digest(given_user, expected_user)
    password_ok = secrets.compare_digest(given_password, expected_password)
    return user_ok and password_ok and bool(expected_user)


def admin_unauthorized(*, presented: bool) -> RequestRefused:
    """The admin API's 401, with its HTTP Basic challenge (RFC 7617): credentials required when none were
    presented (`presented` False), else refused."""
    return RequestRefused(
        401,
        "The admin credentials were refused: wrong username or password (HTTP Basic)."
        if presented
        else "Admin credentials are required (HTTP Basic).",
        "unauthorized",
        type="authentication_error",
        headers={"WWW-Authenticate": 'Basic realm="qiip-admin", charset="UTF-8"'},
    )


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
        max_restore_bytes: the largest body of `POST /admin/state/restore` (a backup), checked once authenticated.
        throttle: failed admin authentications per peer (the admin API's own throttle).
        on_failure: called with `"admin"` for each failed authentication (the metrics counter).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        username: str,
        password: str,
        max_body_bytes: int,
        max_restore_bytes: int | None = None,
        throttle: AuthThrottle,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.app = app
        self._expected = (username.encode("utf-8"), password.encode("utf-8"))
        self.max_body_bytes = max_body_bytes
        self.max_restore_bytes = max_restore_bytes if max_restore_bytes is not None else max_body_bytes
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
        given = header(scope, b"authorization")
        if not self._authenticated(given):
            if given is None or not given.strip():
                # Nothing presented (a first visit, a probe): refused, but no guess to count.
                await _refuse(send, _UNAUTHORIZED)
                return
            self.throttle.failed(peer)
            if self._on_failure is not None:
                self._on_failure("admin")
            logger.warning(
                "admin authentication failed from %s on %s %s",
                peer,
                safe_text(str(scope["method"]), limit=20),
                logged_path(scope),
            )
            await _refuse(send, _REFUSED)
            return
        declared = header(scope, b"content-length")
        limit, setting = admin_body_limit(
            scope, max_body_bytes=self.max_body_bytes, max_restore_bytes=self.max_restore_bytes
        )
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _refuse(send, body_too_large(limit, setting))
            return
        if declared is None and header(scope, b"transfer-encoding") is not None:
            # A body of unknown size: refused before it is read (RFC 9110 §15.5.12).
            await _refuse(send, _LENGTH_REQUIRED)
            return
        await self.app(scope, receive, send)

    def _authenticated(self, value: bytes | None) -> bool:
        return admin_credentials_ok(basic_credentials(value), self._expected)


_UNAUTHORIZED = admin_unauthorized(presented=False)
_REFUSED = admin_unauthorized(presented=True)
_LENGTH_REQUIRED = RequestRefused(411, "Admin requests with a body must declare its Content-Length.", "length_required")


async def _refuse(send: Send, refusal: RequestRefused) -> None:
    """Answer a request the gate refuses, through the daemon's one error mapping (`describe_error`)."""
    status, body, headers = describe_error(refusal)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(name.lower().encode(), value.encode()) for name, value in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
