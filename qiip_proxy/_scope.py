"""What the daemon reads of a request's ASGI scope before any route runs: a header, the peer's address, the path
as a log line may quote it, and the request id every answer carries. The layers, the request steps and the
workers all read a scope; this module sits below them all."""

from __future__ import annotations

import random
import re

from starlette.types import Scope

from qiip_core._errors import safe_text

__all__ = ["RESTORE_PATH", "admin_body_limit", "header", "logged_path", "peer_of", "request_id_for"]

RESTORE_PATH = "/admin/state/restore"
"""The one admin route whose body (a state backup) may exceed `admin.max_body_bytes`."""


def admin_body_limit(scope: Scope, *, max_body_bytes: int, max_restore_bytes: int) -> tuple[int, str]:
    """(the largest body, the setting that sets it) of an admin request: `admin.max_restore_bytes` for
    `RESTORE_PATH`, else `admin.max_body_bytes`."""
    if scope["path"] == RESTORE_PATH:
        return max_restore_bytes, "admin.max_restore_bytes"
    return max_body_bytes, "admin.max_body_bytes"


_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:/+=-]{1,128}$")


def header(scope: Scope, name: bytes) -> bytes | None:
    """The value of request header `name` (lower-case bytes, as ASGI gives names), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def peer_of(scope: Scope) -> str:
    """The client's address, as the server saw it (`unknown` for a Unix socket or a test client)."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def logged_path(scope: Scope) -> str:
    """The request's path as a log line may quote it: control characters escaped, at most 200 characters (a
    `%0a` in the path would otherwise start a forged line)."""
    return safe_text(str(scope.get("path", "")), limit=200)


def request_id_for(scope: Scope) -> str:
    """The client's `X-Request-Id` when it is a sane token (up to 128 characters of `[A-Za-z0-9._:/+=-]`),
    else a new random one (24 hexadecimal digits). Every answer carries it, and the node gets it too.

    A request id names a request in logs; it guards nothing, so it comes from `random` (reseeded in every forked
    process) rather than from the OS (a system call per request)."""
    given = header(scope, b"x-request-id")
    if given is not None and _REQUEST_ID.match(given):
        return given.decode("ascii")
    return f"{random.getrandbits(96):024x}"
