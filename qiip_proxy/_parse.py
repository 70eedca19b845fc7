"""Step 1 of an inference request: parse. Read the client's request, check what the gateway needs of it,
and authenticate its invoke token.

The gateway reads two fields of the body, `model` and `stream` (and bounds `max_tokens`), and hashes the
leading messages (or prompt) of a model routed by prefix affinity; everything else goes to the node byte for
byte. The token header is checked before the body is read, so a request without
a valid token costs nothing more, and the body's size is checked against `server.max_body_bytes` before it
is read whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from typing import TYPE_CHECKING

from starlette.types import Receive, Scope

from qiip_core import AuthError
from qiip_core.auth import InvokeToken, parse_bearer
from qiip_core.nodes import ApiName
from qiip_core.routing import PrefixAffinity, UpstreamRequest
from qiip_proxy._auth_gate import header, peer_of, too_many_failures
from qiip_proxy._errors import TOO_DEEP, RequestRefused

if TYPE_CHECKING:
    from qiip_proxy._gateway import Gateway

__all__ = [
    "CLIENT_CLOSED_REQUEST",
    "PROXY_PATHS",
    "check_invoke_token",
    "parse_request",
    "read_request",
    "request_id_for",
]

logger = logging.getLogger("qiip.auth")

PROXY_PATHS: dict[str, ApiName] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
"""The inference paths, forwarded to nodes as they are, and the API each one is."""

CLIENT_CLOSED_REQUEST = 499
"""The status recorded (never sent) for a request whose client left before the answer began."""

_INT32_MAX = 2**31 - 1

_FORWARDED_HEADERS = frozenset({b"accept", b"traceparent", b"tracestate"})

_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:/+=-]{1,128}$")


def request_id_for(scope: Scope) -> str:
    """The client's `X-Request-Id` when it is a sane token (up to 128 characters of `[A-Za-z0-9._:/+=-]`),
    else a new random one. Every answer carries it, and the node gets it too."""
    given = header(scope, b"x-request-id")
    if given is not None and _REQUEST_ID.match(given):
        return given.decode("ascii")
    return os.urandom(12).hex()


async def parse_request(
    gateway: Gateway, scope: Scope, receive: Receive, request_id: str
) -> tuple[UpstreamRequest, InvokeToken | None]:
    """Read, check and authenticate one inference request.

    Args:
        gateway: the gateway (its body limit and token store).
        scope: the request's ASGI scope.
        receive: its ASGI receive channel.
        request_id: the request's id, forwarded to the node.

    Returns:
        The request ready to forward, and its invoke token (None when tokens are not required).

    Raises:
        RequestRefused: see `read_request`.
        AuthError: the token is missing, unknown, expired, revoked, or bound to another model.
    """
    # The token is checked from the headers, before a byte of the body is read; its model scope after.
    secret = check_invoke_token(gateway, scope)
    request = await read_request(
        scope,
        receive,
        max_body_bytes=gateway.settings.server.max_body_bytes,
        request_id=request_id,
        affinity=gateway.table.affinity,
    )
    token = gateway.tokens.authenticate(secret, model=request.model) if secret is not None else None
    return request, token


def check_invoke_token(gateway: Gateway, scope: Scope) -> str | None:
    """The client API's token check, from the headers alone, for every route of the client API: a peer past its
    failures is refused, and every failure is throttled, counted (`qiip_auth_failures_total{api="client"}`) and
    logged. Check the token's model scope with `gateway.tokens.authenticate(secret, model=…)` after.

    Returns:
        The token's secret, or None when tokens are not required.

    Raises:
        RequestRefused: 429, the peer failed too often.
        AuthError: the token is missing, unknown, expired or revoked.
    """
    if not gateway.tokens_required:
        return None
    peer = peer_of(scope)
    wait_s = gateway.auth_throttle.retry_after_s(peer)
    if wait_s is not None:
        raise too_many_failures(wait_s)
    try:
        secret = parse_bearer(_text_header(scope, b"authorization"))
        gateway.tokens.authenticate(secret, model=None)
    except AuthError as exc:
        gateway.auth_throttle.failed(peer)
        gateway.metrics.auth_failures.labels("client").inc()
        logger.warning("invoke token refused from %s on %s: %s", peer, scope["path"], exc.code)
        raise
    return secret


async def read_request(
    scope: Scope,
    receive: Receive,
    *,
    max_body_bytes: int,
    request_id: str | None = None,
    affinity: PrefixAffinity | None = None,
) -> UpstreamRequest:
    """Read and check a client request, keeping its body byte for byte.

    With `affinity`, a request whose model routes by prefix affinity carries its prefix hashes, computed from
    the body as it was parsed here (`PrefixAffinity.prefix_of`).

    Raises:
        RequestRefused: 413 over `max_body_bytes` (checked before the body is read whole), 400 for a body that
            is not a JSON object, a missing or non-string `model`, a non-boolean `stream` or an out-of-range
            `max_tokens`; 499 (never sent) when the client left while sending it.
    """
    too_large = RequestRefused(
        413, f"The request body is larger than the limit of {max_body_bytes} bytes.", "request_too_large"
    )
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RequestRefused(
                CLIENT_CLOSED_REQUEST, "The client disconnected while sending its request.", "client_disconnected"
            )
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_body_bytes:
            raise too_large
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    try:
        if len(body) <= LARGE_BODY_BYTES:
            payload = json.loads(body)
        else:
            # A large body is parsed off the event loop (other requests, `/health` included, go on), with its
            # object keys counted.
            payload = await asyncio.to_thread(_parse_large, body)
    except ValueError as exc:
        raise RequestRefused(400, f"The request body is not valid JSON: {exc}.", "invalid_json") from None
    except RecursionError:
        raise RequestRefused(400, TOO_DEEP, "invalid_json") from None
    if not isinstance(payload, dict):
        raise RequestRefused(400, "The request body must be a JSON object.", "invalid_json")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise RequestRefused(400, "The request must name a model (a non-empty string).", "missing_model", "model")
    stream = payload.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise RequestRefused(400, "`stream` must be true or false.", "invalid_type", "stream")
    for limit in ("max_tokens", "max_completion_tokens"):
        value = payload.get(limit)
        # llama.cpp reads these as a 32-bit n_predict (-1: until the context ends); beyond, it answers nonsense.
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= _INT32_MAX
        ):
            raise RequestRefused(
                400,
                f"`{limit}` must be a whole number of tokens up to {_INT32_MAX}, got {str(value)[:40]}.",
                "invalid_value",
                limit,
            )
    headers = [("content-type", "application/json"), ("accept-encoding", "identity")]
    headers += [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k in _FORWARDED_HEADERS]
    if request_id is not None:
        headers.append(("x-request-id", request_id))
    path = scope["path"]
    api = PROXY_PATHS.get(path)
    prefix = affinity.prefix_of(model, api, payload) if affinity is not None else ()
    return UpstreamRequest(
        path=path, body=body, headers=headers, model=model, stream=bool(stream), api=api, prefix=prefix
    )


LARGE_BODY_BYTES = 256 * 1024
"""Bodies above this are parsed in a worker thread, their object keys counted."""

MAX_OBJECT_KEYS = 200_000
"""The most object keys a request body may hold in all (a 256 KiB body cannot hold more than about 50,000)."""


def _parse_large(body: bytes) -> object:
    """`json.loads` for a large body, refusing more than `MAX_OBJECT_KEYS` object keys in all.

    Raises:
        ValueError: not JSON, or too many keys.
        RecursionError: nested too deeply.
    """
    keys = 0

    def count(pairs: list[tuple[str, object]]) -> dict[str, object]:
        nonlocal keys
        keys += len(pairs)
        if keys > MAX_OBJECT_KEYS:
            raise ValueError(f"it holds more than {MAX_OBJECT_KEYS} object keys")
        return dict(pairs)

    return json.loads(body, object_pairs_hook=count)


def _text_header(scope: Scope, name: bytes) -> str | None:
    value = header(scope, name)
    return value.decode("latin-1") if value is not None else None
