"""One client inference request through the gateway, top to bottom, as plain ASGI.

**parse** (`read_request`: size limit before the body is read whole, JSON, `model`, `stream`) →
**select and forward** (`Forwarder.open` in the core: the least-loaded eligible node, failover while no
byte has reached the client) → **relay** (status and headers, then whole SSE events or body chunks as
they come; a failure after the first byte ends a stream with one in-band error event and
`data: [DONE]`) → **account** (`GatewayMetrics.account`).

The client connection is watched the whole time: a disconnect, while waiting for the first token or
mid-stream, cancels the relay, which closes the node's request and releases the reservation.

`ProxyRoutes` serves the three inference paths ahead of the FastAPI app: they are the hot path, and
skipping the framework's routing and middleware layers roughly doubles the requests a core can relay
(docs/performance.md). The FastAPI routes of the same paths call the same code and document them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qiip_core import (
    AuthError,
    FailoverExhausted,
    ModelNotFound,
    NoNodes,
    QiipError,
    RoutingError,
    TokenRevoked,
    UpstreamError,
)
from qiip_core.auth import InvokeToken, parse_bearer
from qiip_core.nodes import ApiName
from qiip_core.routing import UpstreamRequest, UpstreamResponse
from qiip_proxy._errors import SSE_DONE, TOO_DEEP, ClientError, describe_error, error_body, sse_error_event

if TYPE_CHECKING:
    from qiip_proxy._gateway import Gateway

__all__ = ["PROXY_PATHS", "ProxyRoutes", "read_request", "serve_inference"]

_INT32_MAX = 2**31 - 1

logger = logging.getLogger("qiip.proxy")

PROXY_PATHS: dict[str, ApiName] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
"""The inference paths, forwarded to nodes as they are, and the API each one is."""

CLIENT_CLOSED_REQUEST = 499
"""The status recorded (never sent) for a request whose client left before the answer began."""

_FORWARDED_HEADERS = frozenset({b"accept", b"traceparent", b"tracestate"})


class ProxyRoutes:
    """ASGI middleware: `POST` to an inference path is relayed here; everything else goes to `app`.

    Args:
        app: the daemon's application.
        gateway: the gateway it serves.
    """

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "POST" and scope["path"] in PROXY_PATHS:
            await serve_inference(self.gateway, scope, receive, send)
            return
        request_id = request_id_for(scope).encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


_SHUTDOWN_EVENT = (
    b"data: "
    + error_body(
        "The gateway is shutting down and ended this stream; retry the request.",
        type="service_unavailable_error",
        code="gateway_shutdown",
    )
    + b"\n\n"
)

_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:/+=-]{1,128}$")


def request_id_for(scope: Scope) -> str:
    """The client's `X-Request-Id` when it is a sane token (up to 128 characters of `[A-Za-z0-9._:/+=-]`),
    else a new random one. Every answer carries it, and the node gets it too."""
    given = _header(scope, b"x-request-id")
    if given is not None and _REQUEST_ID.match(given):
        return given.decode("ascii")
    return os.urandom(12).hex()


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def serve_inference(gateway: Gateway, scope: Scope, receive: Receive, send: Send) -> None:
    """Serve one inference request (`scope["path"]` is one of `PROXY_PATHS`) completely."""
    started = time.perf_counter()
    request_id = request_id_for(scope)
    token: InvokeToken | None = None
    try:
        # The header is checked before the body is read: a request without a token costs nothing more.
        secret = parse_bearer(_text_header(scope, b"authorization")) if gateway.tokens_required else None
        request = await read_request(
            scope, receive, max_body_bytes=gateway.settings.server.max_body_bytes, request_id=request_id
        )
        if secret is not None:
            token = gateway.tokens.authenticate(secret, model=request.model)
    except (ClientError, AuthError) as exc:
        if exc.code != "client_disconnected":
            await send_error(send, exc, request_id)
        gateway.metrics.account(model="", node="", status=exc.status, duration_s=0.0, error_code=exc.code)
        return
    await _Relay(gateway, request, request_id, started, token).run(receive, send)


def _text_header(scope: Scope, name: bytes) -> str | None:
    value = _header(scope, name)
    return value.decode("latin-1") if value is not None else None


async def read_request(
    scope: Scope, receive: Receive, *, max_body_bytes: int, request_id: str | None = None
) -> UpstreamRequest:
    """Read and check a client request, keeping its body byte for byte.

    Raises:
        ClientError: 413 over `max_body_bytes` (checked before the body is read whole), 400 for a body that
            is not a JSON object, a missing or non-string `model`, or a non-boolean `stream`.
    """
    too_large = ClientError(
        413, f"The request body is larger than the limit of {max_body_bytes} bytes.", "request_too_large"
    )
    declared = _header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientError(
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
        payload = json.loads(body)
    except ValueError as exc:
        raise ClientError(400, f"The request body is not valid JSON: {exc}.", "invalid_json") from None
    except RecursionError:
        raise ClientError(400, TOO_DEEP, "invalid_json") from None
    if not isinstance(payload, dict):
        raise ClientError(400, "The request body must be a JSON object.", "invalid_json")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise ClientError(400, "The request must name a model (a non-empty string).", "missing_model", "model")
    stream = payload.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise ClientError(400, "`stream` must be true or false.", "invalid_type", "stream")
    for limit in ("max_tokens", "max_completion_tokens"):
        value = payload.get(limit)
        # llama.cpp reads these as a 32-bit n_predict (-1: until the context ends); beyond, it answers nonsense.
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= _INT32_MAX
        ):
            raise ClientError(
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
    return UpstreamRequest(
        path=path, body=body, headers=headers, model=model, stream=bool(stream), api=PROXY_PATHS.get(path)
    )


async def send_error(
    send: Send, exc: QiipError | ClientError, request_id: str, extra: dict[str, str] | None = None
) -> None:
    """Send a complete OpenAI error response (before anything else was sent)."""
    status, kind, code, param, headers = describe_error(exc)
    body = error_body(exc.message, type=kind, code=code, param=param)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in {**headers, **(extra or {})}.items()]
    raw.append((b"x-request-id", request_id.encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class _Relay:
    """Forwards one parsed request and relays the answer, watching the client connection throughout."""

    __slots__ = ("_disconnected", "_ended", "_task", "gateway", "request", "request_id", "started", "token")

    def __init__(
        self,
        gateway: Gateway,
        request: UpstreamRequest,
        request_id: str,
        started: float,
        token: InvokeToken | None = None,
    ) -> None:
        self.gateway = gateway
        self.request = request
        self.request_id = request_id
        self.started = started
        self.token = token
        self._disconnected = False
        self._ended: QiipError | None = None
        self._task: asyncio.Task[Any] | None = None

    def end_for_revocation(self) -> None:
        """The request's invoke token was revoked or expired: end the request now (in-band for a stream)."""
        if self._ended is None and self._task is not None:
            token_id = self.token.id if self.token is not None else "?"
            self._ended = TokenRevoked(
                f"The invoke token {token_id} was revoked or expired; this request was ended.", token_id=token_id
            )
            self._task.cancel()

    async def run(self, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        watcher = asyncio.create_task(self._watch(receive, task))
        streams = None
        if self.token is not None:
            streams = self.gateway.streams_by_token.setdefault(self.token.id, set())
            streams.add(self.end_for_revocation)
            if not self.gateway.tokens.is_valid(self.token.id):
                self.end_for_revocation()
        try:
            await self._relay(send)
        except asyncio.CancelledError:
            if not (self._disconnected or self._ended is not None):
                raise
            task.uncancel()
        finally:
            watcher.cancel()
            if streams is not None:
                streams.discard(self.end_for_revocation)

    def _ended_code(self) -> str:
        return str(getattr(self._ended, "code", "ended"))

    def _ended_status(self) -> int:
        return int(getattr(self._ended, "status", 500))

    async def _watch(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        while True:
            message: Message = await receive()
            if message["type"] == "http.disconnect":
                self._disconnected = True
                task.cancel()
                return

    async def _relay(self, send: Send) -> None:
        gateway, request = self.gateway, self.request
        try:
            upstream = await gateway.forwarder.open(request)
        except asyncio.CancelledError:
            if self._disconnected or self._ended is not None:
                if self._ended is not None:
                    await send_error(send, self._ended, self.request_id)
                gateway.metrics.account(
                    model=request.model,
                    node="",
                    status=CLIENT_CLOSED_REQUEST if self._ended is None else self._ended_status(),
                    duration_s=time.perf_counter() - self.started,
                    error_code="client_disconnected" if self._ended is None else self._ended_code(),
                )
            raise
        except (RoutingError, UpstreamError) as exc:
            await send_error(send, exc, self.request_id)
            # Every failed attempt but the last was retried elsewhere.
            earlier = exc.failures[:-1] if isinstance(exc, FailoverExhausted) else []
            gateway.metrics.account(
                # A model no node serves is the client's word only: keep it out of the label set.
                model="" if isinstance(exc, ModelNotFound | NoNodes) else request.model,
                node="",
                status=exc.status,
                duration_s=time.perf_counter() - self.started,
                error_code=exc.code,
                failed_nodes=[e.node_id for e in earlier if e.node_id],
            )
            return
        ttft: float | None = None
        error_code: str | None = None
        try:
            headers = upstream.headers
            headers.append((b"x-request-id", self.request_id.encode()))
            if upstream.sse:
                headers += [(b"x-accel-buffering", b"no"), (b"cache-control", b"no-cache")]
            if upstream.complete:
                headers.append((b"content-length", str(len(upstream.prefix)).encode()))
                await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers})
                await send({"type": "http.response.body", "body": upstream.prefix})
            else:
                await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers})
                await send({"type": "http.response.body", "body": upstream.prefix, "more_body": True})
                if upstream.sse:
                    ttft = time.perf_counter() - self.started
                error_code = await self._relay_rest(upstream, send)
            if error_code is None and upstream.status_code < 400:
                gateway.table.record_success(upstream.node_id)
        except asyncio.CancelledError:
            if self._disconnected:
                error_code = "client_disconnected"
                logger.info("client disconnected; closed its request to node %s", upstream.node_id)
            elif upstream.sse:
                # The token was revoked, or the daemon is stopping after its grace period: end the stream
                # honestly, with one error event.
                event = sse_error_event(self._ended) if self._ended is not None else _SHUTDOWN_EVENT
                error_code = self._ended_code() if self._ended is not None else "gateway_shutdown"
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                    await send({"type": "http.response.body", "body": SSE_DONE})
            raise
        finally:
            await upstream.aclose()
            gateway.metrics.account(
                model=request.model,
                node=upstream.node_id,
                status=upstream.status_code,
                duration_s=time.perf_counter() - self.started,
                ttft_s=ttft,
                error_code=error_code,
                failed_nodes=[e.node_id for e in upstream.failures if e.node_id],
            )

    async def _relay_rest(self, upstream: UpstreamResponse, send: Send) -> str | None:
        """Relay the rest of the body. Returns the error code of a mid-stream failure, or None."""
        try:
            while chunk := await upstream.read():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as exc:
            self.gateway.table.record_failure(upstream.node_id, exc.message)
            logger.warning("node %s failed mid-response: %s", upstream.node_id, exc.message)
            if not upstream.sse:
                # Headers are out and the body is incomplete: the only honest signal left is to break the
                # connection, so the client cannot mistake a truncated body for a whole one.
                raise
            await send({"type": "http.response.body", "body": sse_error_event(exc), "more_body": True})
            await send({"type": "http.response.body", "body": SSE_DONE})
            return exc.code
        await send({"type": "http.response.body", "body": b""})
        return None
