"""The OpenAI-compatible client API: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
`/v1/models`, and `/health`.

One request, top to bottom: **parse** (`read_upstream_request`: size limit, JSON, `model`, `stream`) →
**select and forward** (`Forwarder.open`: least-connections node, failover until a first byte is ready) →
**relay** (`RelayResponse`: status and headers, then whole events or body chunks as they come; a failure
after the first byte ends a stream with one in-band error event and `[DONE]`) → **account**
(`GatewayMetrics.account`). A client that disconnects at any point cancels the relay at once, which closes
the node's request and releases the reservation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from qiip_core import FailoverExhausted, RoutingError, UpstreamError
from qiip_core.nodes import NodeStatus
from qiip_core.routing import UpstreamRequest, UpstreamResponse
from qiip_proxy._errors import SSE_DONE, ClientError, error_response, sse_error_event

if TYPE_CHECKING:
    from qiip_proxy._gateway import Gateway

__all__ = ["RelayResponse", "read_upstream_request", "router"]

logger = logging.getLogger("qiip.proxy")

router = APIRouter()

_FORWARDED_HEADERS = frozenset({"accept", "x-request-id", "traceparent", "tracestate"})

_REQUEST_SCHEMA: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["model"],
                    "properties": {
                        "model": {"type": "string", "description": "The model alias a node serves."},
                        "stream": {"type": "boolean", "description": "Answer with server-sent events."},
                    },
                    "additionalProperties": True,
                }
            }
        },
    }
}


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def read_upstream_request(request: Request, path: str, *, max_body_bytes: int) -> UpstreamRequest:
    """Read and check a client request, keeping its body byte for byte.

    Raises:
        ClientError: 413 over `max_body_bytes` (checked before the body is read whole), 400 for a body that
            is not a JSON object, a missing or non-string `model`, or a non-boolean `stream`.
    """
    declared = request.headers.get("content-length")
    too_large = ClientError(
        413,
        f"The request body is larger than the limit of {max_body_bytes} bytes.",
        "request_too_large",
    )
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise too_large
        chunks.append(chunk)
    body = b"".join(chunks)
    try:
        payload = json.loads(body)
    except ValueError as exc:
        raise ClientError(400, f"The request body is not valid JSON: {exc}.", "invalid_json") from None
    if not isinstance(payload, dict):
        raise ClientError(400, "The request body must be a JSON object.", "invalid_json")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise ClientError(400, "The request must name a model (a non-empty string).", "missing_model", "model")
    stream = payload.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise ClientError(400, "`stream` must be true or false.", "invalid_type", "stream")
    headers = [("content-type", "application/json")]
    headers += [(k, v) for k, v in request.headers.items() if k in _FORWARDED_HEADERS]
    return UpstreamRequest(path=path, body=body, headers=headers, model=model, stream=bool(stream))


class RelayResponse(Response):
    """Forwards one parsed request and relays the node's answer, as an ASGI response.

    It watches the client connection the whole time: a disconnect (while waiting for the first token or
    mid-stream) cancels the relay, which closes the node's request and releases the reservation.
    """

    def __init__(self, gateway: Gateway, request: UpstreamRequest, request_id: str) -> None:
        self.gateway = gateway
        self.request = request
        self.request_id = request_id
        self.background = None
        self._disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(self._watch(receive, task))
        try:
            await self._relay(send)
        except asyncio.CancelledError:
            if not self._disconnected:
                raise
            task.uncancel()
        finally:
            watcher.cancel()

    async def _watch(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._disconnected = True
                task.cancel()
                return

    async def _relay(self, send: Send) -> None:
        gateway, request = self.gateway, self.request
        metrics = gateway.metrics
        started = time.perf_counter()
        try:
            upstream = await gateway.forwarder.open(request)
        except (RoutingError, UpstreamError) as exc:
            # Every failed attempt but the last was retried elsewhere.
            earlier = exc.failures[:-1] if isinstance(exc, FailoverExhausted) else []
            failed = [e.node_id for e in earlier if e.node_id]
            await error_response(exc, headers={"x-request-id": self.request_id})({"type": "http"}, _no_receive, send)
            metrics.account(
                model=request.model,
                node="",
                status=exc.status,
                duration_s=time.perf_counter() - started,
                error_code=exc.code,
                failed_nodes=failed,
            )
            return
        node_id = upstream.node_id
        failed = [e.node_id for e in upstream.failures if e.node_id]
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
                    ttft = time.perf_counter() - started
                error_code = await self._relay_rest(upstream, send)
            if error_code is None and upstream.status_code < 400:
                gateway.table.record_success(node_id)
        except asyncio.CancelledError:
            if self._disconnected:
                error_code = "client_disconnected"
                logger.info("client disconnected; closed the request to node %s", node_id)
            raise
        finally:
            await upstream.aclose()
            metrics.account(
                model=request.model,
                node=node_id,
                status=upstream.status_code,
                duration_s=time.perf_counter() - started,
                ttft_s=ttft,
                error_code=error_code,
                failed_nodes=failed,
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


async def _no_receive() -> dict[str, Any]:
    raise RuntimeError("an error response does not read the request")


async def _proxy(request: Request, path: str) -> Response:
    gateway = _gateway(request)
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    try:
        upstream_request = await read_upstream_request(
            request, path, max_body_bytes=gateway.settings.server.max_body_bytes
        )
    except ClientError as exc:
        gateway.metrics.account(model="", node="", status=exc.status, duration_s=0.0, error_code=exc.code)
        return error_response(exc, headers={"x-request-id": request_id})
    return RelayResponse(gateway, upstream_request, request_id)


@router.post("/v1/chat/completions", tags=["client"], openapi_extra=_REQUEST_SCHEMA)
async def chat_completions(request: Request) -> Response:
    """Create a chat completion (OpenAI `POST /v1/chat/completions`), streamed with `"stream": true`."""
    return await _proxy(request, "/v1/chat/completions")


@router.post("/v1/completions", tags=["client"], openapi_extra=_REQUEST_SCHEMA)
async def completions(request: Request) -> Response:
    """Create a text completion (OpenAI `POST /v1/completions`)."""
    return await _proxy(request, "/v1/completions")


@router.post("/v1/embeddings", tags=["client"], openapi_extra=_REQUEST_SCHEMA)
async def embeddings(request: Request) -> Response:
    """Create embeddings (OpenAI `POST /v1/embeddings`)."""
    return await _proxy(request, "/v1/embeddings")


def _model_object(model: str, owned_by: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": owned_by}


@router.get("/v1/models", tags=["client"])
async def list_models(request: Request) -> JSONResponse:
    """The models served by at least one healthy node (OpenAI `GET /v1/models`)."""
    served = _gateway(request).table.models()
    data = [_model_object(model, engine.value) for model, engine in sorted(served.items())]
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{model:path}", tags=["client"])
async def retrieve_model(request: Request, model: str) -> Response:
    """One model (OpenAI `GET /v1/models/{model}`): 404 when no node serves it, 503 when none is healthy."""
    table = _gateway(request).table
    served = table.models()
    if model in served:
        return JSONResponse(_model_object(model, served[model].value))
    return error_response(table.routing_error(model))


@router.get("/health", tags=["client"])
async def health(request: Request) -> JSONResponse:
    """Gateway health: `status` (`ok`, or `degraded` when the registry is failing), `nodes_registered`,
    `nodes_healthy`, and the registry's state."""
    gateway = _gateway(request)
    counts = gateway.table.count_by_status()
    registry = gateway.registry.status()
    return JSONResponse(
        {
            "status": "ok" if registry.health.value == "ok" else "degraded",
            "nodes_registered": len(gateway.table),
            "nodes_healthy": counts.get(NodeStatus.HEALTHY, 0),
            "registry": {
                "backend": registry.backend,
                "state": registry.health.value,
                "detail": registry.detail,
            },
        }
    )
