"""Step 1 of an inference request: parse. Read the client's request, check what the gateway needs of it,
and authenticate its invoke token.

The gateway reads two fields of the body, `model` and `stream` (and bounds `max_tokens`), and hashes the
leading messages (or prompt) of a model routed by prefix affinity; everything else goes to the node byte for
byte. The token header is checked before the body is read, so a request without
a valid token costs nothing more; so is the content type (JSON only: a web page cannot send JSON to another site
without asking first), and the body's size is checked against `server.max_body_bytes` before it is read whole.
What the parse may cost is bounded before it starts (`check_json_budget`): a body too large to be cheap has its
members and values counted, in slices of the event loop, and is parsed in a worker thread, one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from starlette.types import Receive, Scope

from qiip_core import AuthError
from qiip_core.auth import InvokeToken, parse_bearer
from qiip_core.nodes import ApiName
from qiip_core.routing import PrefixAffinity
from qiip_core.upstream import UpstreamRequest
from qiip_proxy._errors import TOO_DEEP, RequestRefused, body_too_large
from qiip_proxy._scope import header, logged_path, peer_of
from qiip_proxy._strict_json import NotOneReading, strict_loads
from qiip_proxy.layers._auth_gate import too_many_failures

if TYPE_CHECKING:
    from qiip_proxy._types import ServingGateway

__all__ = [
    "CLIENT_CLOSED_REQUEST",
    "LARGE_BODY_BYTES",
    "MAX_JSON_VALUES",
    "MAX_OBJECT_KEYS",
    "PROXY_PATHS",
    "check_invoke_token",
    "check_json_budget",
    "is_json",
    "parse_request",
    "read_request",
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


async def parse_request(
    gateway: ServingGateway, scope: Scope, receive: Receive, request_id: str
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
        parse_gate=gateway.parse_gate,
    )
    token = gateway.tokens.authenticate(secret, model=request.model) if secret is not None else None
    return request, token


def check_invoke_token(gateway: ServingGateway, scope: Scope) -> str | None:
    """The client API's token check, from the headers alone, for every route of the client API: a peer past its
    failures is refused, and every token presented and refused is throttled (`Gateway.client_throttle`, apart
    from the admin API's), counted (`qiip_auth_failures_total{api="client"}`) and logged; a request without any
    token is refused without counting. Check the token's model scope with
    `gateway.tokens.authenticate(secret, model=…)` after.

    Returns:
        The token's secret, or None when tokens are not required.

    Raises:
        RequestRefused: 429, the peer failed too often.
        AuthError: the token is missing, unknown, expired or revoked.
    """
    if not gateway.tokens_required:
        return None
    peer = peer_of(scope)
    throttle = gateway.client_throttle
    wait_s = throttle.retry_after_s(peer)
    if wait_s is not None:
        raise too_many_failures(wait_s)
    given = _text_header(scope, b"authorization")
    try:
        secret = parse_bearer(given)
        gateway.tokens.authenticate(secret, model=None)
    except AuthError as exc:
        if given is None or not given.strip():
            # Nothing presented (the chat page's first load, a probe): refused, but no guess to count.
            raise
        throttle.failed(peer)
        gateway.metrics.auth_failures.labels("client").inc()
        logger.warning("invoke token refused from %s on %s: %s", peer, logged_path(scope), exc.code)
        raise
    return secret


async def read_request(
    scope: Scope,
    receive: Receive,
    *,
    max_body_bytes: int,
    request_id: str | None = None,
    affinity: PrefixAffinity | None = None,
    parse_gate: asyncio.Semaphore | None = None,
) -> UpstreamRequest:
    """Read and check a client request, keeping its body byte for byte.

    With `affinity`, a request whose model routes by prefix affinity carries its prefix hashes, computed from
    the body as it was parsed here (`PrefixAffinity.prefix_of`).

    Args:
        scope: the request's ASGI scope.
        receive: its ASGI receive channel.
        max_body_bytes: the largest body read (`server.max_body_bytes`).
        request_id: the request's id, forwarded to the node.
        affinity: prefix affinity's map, for the request's prefix hashes.
        parse_gate: held while a body over `LARGE_BODY_BYTES` is measured and parsed (in a worker thread), so
            that such bodies take the interpreter one at a time and every other request gets it between them.

    Raises:
        RequestRefused: 415 for a `Content-Type` other than `application/json`; 413 over `max_body_bytes`
            (checked before the body is read whole); 400 for a body that is not a JSON object, holds more than
            `check_json_budget` allows, or has a missing or non-string `model`, a non-boolean `stream` or an
            out-of-range `max_tokens`; 499 (never sent) when the client left while sending it.
    """
    if not is_json(header(scope, b"content-type")):
        # A web page can send text/plain (or a form) to any address without a CORS preflight; JSON it cannot.
        raise RequestRefused(
            415,
            "The request body must be JSON, sent with 'Content-Type: application/json'.",
            "unsupported_media_type",
        )
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise body_too_large(max_body_bytes, "server.max_body_bytes")
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
            raise body_too_large(max_body_bytes, "server.max_body_bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    if len(body) <= LARGE_BODY_BYTES:
        # Too short to pass a bound of `check_json_budget` (`_decode` would parse it at once): parsed here.
        payload = _loads(body)
    else:
        async with parse_gate or contextlib.nullcontext():
            payload = await _decode(body, in_thread=True)
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


def is_json(content_type: bytes | None) -> bool:
    """Whether a `Content-Type` value is `application/json` (any parameters, such as `charset`, allowed)."""
    if content_type is None:
        return False
    return content_type.split(b";", 1)[0].strip().lower() == b"application/json"


LARGE_BODY_BYTES = 64 * 1024
"""Bodies above this are measured and parsed one at a time (`read_request`'s `parse_gate`); it is below what any
bound of `check_json_budget` can be passed with, so a body up to it is parsed at once."""

MAX_OBJECT_KEYS = 50_000
"""The most object members a request body may hold in all (each costs about 1 µs to parse: a dict entry)."""

MAX_JSON_VALUES = 500_000
"""The most array elements and object members a request body may hold in all (about 0.1 to 0.4 µs each to
parse): OpenAI's embeddings limit of 300,000 input tokens a request, given as token ids, fits."""

_WINDOW_BYTES = 256 * 1024
"""`check_json_budget` measures a body this much at a time, and lets the event loop run other work between."""


async def _decode(body: bytes, *, in_thread: bool) -> object:
    """The body's JSON, once `check_json_budget` has found it within bounds.

    Args:
        body: the request body.
        in_thread: parse in a worker thread. `json.loads` holds the interpreter while it runs, but a thread gives
            it back to the event loop at least every switch interval (5 ms) between two parses, so a request such
            as `/health` waits for one parse at most, not for every parse queued.

    Raises:
        RequestRefused: 400 `json_too_complex` past a bound; 400 `invalid_json` for a body that is not JSON.
    """
    if len(body) < min(5 * MAX_OBJECT_KEYS, 2 * MAX_JSON_VALUES):
        # Too short to pass a bound: a member takes at least 5 bytes (`"":0,`), a value 2 (`0,`). The usual request
        # costs nothing more than its parse.
        return await asyncio.to_thread(_loads, body) if in_thread else _loads(body)
    # At a glance: counted over the whole body, strings included, these bound what is outside strings, so a body
    # within them needs no closer look. Counted a window at a time, the event loop free between.
    opens = colons = commas = 0
    for start in range(0, len(body), _WINDOW_BYTES * 4):
        if start:
            await asyncio.sleep(0)
        end = start + _WINDOW_BYTES * 4
        opens += body.count(b"{", start, end) + body.count(b"[", start, end)
        colons += body.count(b":", start, end)
        commas += body.count(b",", start, end)
        if colons > MAX_OBJECT_KEYS or commas + opens > MAX_JSON_VALUES:
            await check_json_budget(body)
            break
    return await asyncio.to_thread(_loads, body) if in_thread else _loads(body)


def _loads(body: bytes) -> object:
    try:
        return strict_loads(body)
    except NotOneReading as exc:
        raise RequestRefused(400, f"The request body is not valid JSON: {exc.construct}.", "invalid_json") from None
    except ValueError as exc:
        raise RequestRefused(400, f"The request body is not valid JSON: {exc}.", "invalid_json") from None
    except RecursionError:
        raise RequestRefused(400, TOO_DEEP, "invalid_json") from None


async def check_json_budget(body: bytes) -> None:
    """Refuse a JSON body that would cost the event loop more than a bounded slice to parse, before it is parsed.

    `json.loads` holds the interpreter for as long as it runs, in any thread; its cost grows with the body's size
    and with the number of values it creates (a dict entry costs about 1 µs). This counts, outside strings, the
    object members and the values (array elements and object members), `_WINDOW_BYTES` at a time with C-speed
    byte operations, awaiting between windows, and stops at the first bound passed. A body within the bounds
    then parses in about 10 to 20 ms per MiB of escaped strings plus at most about 0.2 s for its values (2-core
    test machine); its nesting is bounded during the parse, by the interpreter's recursion limit (about 1,000
    levels: 400 `invalid_json`, nested too deeply). A body that is not valid JSON may measure as anything; the
    parse refuses it after.

    Args:
        body: the request body.

    Raises:
        RequestRefused: 400 `json_too_complex`: more than `MAX_OBJECT_KEYS` object members or `MAX_JSON_VALUES`
            values in all.
    """
    in_string = False
    keys = values = 0
    start, size = 0, len(body)
    while start < size:
        end = min(start + _WINDOW_BYTES, size)
        window = body[start:end]
        if end < size and (len(window) - len(window.rstrip(b"\\"))) % 2:
            # A window never ends inside an escape (it starts where a pair of backslashes or an escape ended): an
            # odd run of backslashes at its end takes the byte it escapes along.
            end += 1
            window = body[start:end]
        # Escaped backslashes, then escaped quotes, go; every quote left opens or closes a string.
        window = window.replace(b"\\\\", b"").replace(b'\\"', b"")
        pieces = window.split(b'"')
        outside = b"".join(pieces[1 if in_string else 0 :: 2])
        if len(pieces) % 2 == 0:
            in_string = not in_string
        del window, pieces
        keys += outside.count(b":")
        values += outside.count(b",") + outside.count(b"{") + outside.count(b"[")
        if keys > MAX_OBJECT_KEYS:
            raise _too_complex(f"more than {MAX_OBJECT_KEYS} object members")
        if values > MAX_JSON_VALUES:
            raise _too_complex(f"more than {MAX_JSON_VALUES} values (array elements and object members)")
        start = end
        if start < size:
            await asyncio.sleep(0)


def _too_complex(what: str) -> RequestRefused:
    return RequestRefused(
        400, f"The request body holds {what}; the gateway does not parse bodies that large.", "json_too_complex"
    )


def _text_header(scope: Scope, name: bytes) -> str | None:
    value = header(scope, name)
    return value.decode("latin-1") if value is not None else None
