"""One client inference request through the gateway, top to bottom, as plain ASGI.

`serve_inference` takes the request through its five steps, each in a module of its own, in this order:

1. **parse** (`_parse`): size limit before the body is read whole, JSON, `model`, `stream`, the invoke token;
2. **admit and select** (`Admission.admit`, `RoutingTable.reserve`, in the core): shed the request when its
   model already has as many requests in flight as `[admission]` allows, else reserve the least-loaded
   eligible node serving the model, or, under prefix affinity, the one holding the request's prompt prefix
   (hashed in step 1);
3. **forward** (`Forwarder.open`, in the core): send it there, failing over to the next node while no byte
   has reached the client, until the node's first bytes commit the gateway to its answer;
4. **relay** (`_relay`): status and headers, then whole SSE events or body chunks as they come; the
   committed answer counts as the node's success or failure by itself when it ends;
5. **account** (`_metrics`): the request's one `Outcome`, recorded in one `finally` however it ended.

The client connection is watched from the moment the request is read: a disconnect, while waiting for the
first token or mid-stream, cancels the request, which closes the node's request and releases the
reservation. So does revoking the request's invoke token (or its expiry), and a stream then ends with one
in-band error event.

`ProxyRoutes` serves the three inference paths ahead of the FastAPI app: they are the hot path, and
skipping the framework's routing and middleware layers roughly doubles the requests a core can relay
(docs/performance.md). The FastAPI routes of the same paths call the same code and document them. Where no layer
but the `Host` check stands in front of them (no CORS, no forwarded headers), the HTTP server answers them itself,
ahead of all ASGI layers (`DirectInference`, `server._fast`), with the same steps and the same check.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qiip_core import (
    AuthError,
    FailoverExhausted,
    ModelNotFound,
    ModelOverloaded,
    ModelUnavailable,
    NoNodes,
    QiipError,
    RoutingError,
    TokenRevoked,
    UpstreamError,
)
from qiip_core.auth import InvokeToken
from qiip_core.routing import ExpectedModel
from qiip_core.upstream import UpstreamRequest, UpstreamResponse
from qiip_proxy._errors import RequestRefused, send_error, sse_error_event
from qiip_proxy._metrics import Outcome
from qiip_proxy._parse import CLIENT_CLOSED_REQUEST, PROXY_PATHS, parse_request
from qiip_proxy._relay import SHUTDOWN_EVENT, BodyWriter, end_stream, relay
from qiip_proxy._scope import request_id_for
from qiip_proxy.layers._http import HostCheck

if TYPE_CHECKING:
    from qiip_proxy._types import ServingGateway

__all__ = ["DirectClient", "DirectInference", "ProxyRoutes", "serve_inference", "wait_for_replica"]

Watch = Callable[[Callable[[], None]], None]
"""Registers the callback a request wants called once, when its client leaves (`DirectClient.watch`)."""


class DirectClient(BodyWriter, Protocol):
    """The client of a request the server answers itself (`server._fast.DirectCycle`)."""

    def watch(self, left: Callable[[], None]) -> None:
        """Call `left` once, when the client leaves before the answer's end."""


logger = logging.getLogger("qiip.proxy")


async def wait_for_replica(gateway: ServingGateway, model: str, expected: ExpectedModel) -> None:
    """Hold a request for `model` until a node serving it is routable, for at most `expected.wait_s` seconds, with
    at most `expected.queue` requests waiting in this process; it counts as queued meanwhile (`DemandMeter`), and
    the controller is woken to start a replica.

    Raises:
        ModelUnavailable: the queue is full, or no replica became routable in time (503, with `Retry-After`).
    """
    meter = gateway.demand_meter
    if meter.queued(model) >= expected.queue:
        raise _not_started(model, expected, f"{expected.queue} request(s) already wait for it")
    with meter.waiting(model):
        gateway.wake_controller()
        if await gateway.table.wait_routable(model, expected.wait_s):
            return
    raise _not_started(model, expected, f"no replica became ready within {expected.wait_s:g} s")


def _not_started(model: str, expected: ExpectedModel, why: str) -> ModelUnavailable:
    error = ModelUnavailable(f"The model {model!r} is not served yet: {expected.why}; {why}; retry later.", model=model)
    error.retry_after_s = expected.retry_after_s if expected.retry_after_s is not None else 10.0
    return error


class ProxyRoutes:
    """ASGI middleware: `POST` to an inference path is served here; everything else goes to `app`.

    Args:
        app: the daemon's application.
        gateway: the gateway it serves.
    """

    def __init__(self, app: ASGIApp, gateway: ServingGateway) -> None:
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


class DirectInference:
    """The inference paths as the HTTP server answers them itself (`server._fast.DirectRoute`): the `Host` check
    of `AllowedHosts`, then `serve_inference`, the client's leaving told by the server rather than watched.

    Args:
        gateway: the gateway serving them.
        hosts: the `Host` check, or None when `server.allowed_hosts` holds `*`.
    """

    paths = frozenset(path.encode() for path in PROXY_PATHS)
    """The request targets answered (exactly: no query, no escapes)."""

    def __init__(self, gateway: ServingGateway, hosts: HostCheck | None) -> None:
        self.gateway = gateway
        self.hosts = hosts

    async def serve(self, scope: Scope, receive: Receive, send: Send, client: DirectClient) -> None:
        """Serve one request completely (see `serve_inference`)."""
        hosts = self.hosts
        if hosts is not None and not hosts.passes(scope):
            await hosts.refuse(scope, send)
            return
        await serve_inference(self.gateway, scope, receive, send, watch=client.watch, writer=client)


async def serve_inference(
    gateway: ServingGateway,
    scope: Scope,
    receive: Receive,
    send: Send,
    *,
    watch: Watch | None = None,
    writer: BodyWriter | None = None,
) -> None:
    """Serve one inference request (`scope["path"]` is one of `PROXY_PATHS`) completely.

    Args:
        gateway: the gateway serving it.
        scope: the request's ASGI scope.
        receive: its ASGI receive channel.
        send: its ASGI send channel.
        watch: how the server tells the request that its client left (`DirectInference`); None: a task of the
            request's own waits on `receive` for `http.disconnect`.
        writer: the client's body written without ASGI messages, where the server offers it (`relay`).
    """
    outcome = Outcome(started=time.perf_counter())
    try:
        await _InferenceRequest(gateway, request_id_for(scope), outcome, writer).serve(scope, receive, send, watch)
    finally:
        # 5. account
        outcome.duration_s = time.perf_counter() - outcome.started
        gateway.metrics.account(outcome)


class _InferenceRequest:
    """One inference request on its way, and what ends it early: the client leaving, or its token revoked."""

    __slots__ = (
        "_disconnected",
        "_ended",
        "_stopped",
        "_task",
        "gateway",
        "outcome",
        "request_id",
        "token",
        "writer",
    )

    def __init__(
        self, gateway: ServingGateway, request_id: str, outcome: Outcome, writer: BodyWriter | None = None
    ) -> None:
        self.gateway = gateway
        self.writer = writer
        self.request_id = request_id
        self.outcome = outcome
        self.token: InvokeToken | None = None
        self._disconnected = False
        # Ended in-band because the daemon is stopping.
        self._stopped = False
        self._ended: QiipError | None = None
        self._task: asyncio.Task[Any] | None = None

    async def serve(self, scope: Scope, receive: Receive, send: Send, watch: Watch | None) -> None:
        """Parse the request, then forward and relay it while watching the client connection."""
        outcome = self.outcome
        # 1. parse
        try:
            request, self.token = await parse_request(self.gateway, scope, receive, self.request_id)
        except (RequestRefused, AuthError) as exc:
            if exc.code != "client_disconnected":
                await send_error(send, exc, self.request_id)
            outcome.status, outcome.error_code = exc.status, exc.code
            return
        outcome.model = request.model
        # 2. admit: a shed request costs no task, and nothing between here and the reservation awaits, so
        # concurrent requests never overshoot the bound.
        try:
            self.gateway.admission.admit(request.model)
        except ModelOverloaded as exc:
            await send_error(send, exc, self.request_id)
            self.gateway.metrics.shed.labels(request.model, exc.reason).inc()
            outcome.status, outcome.error_code = exc.status, exc.code
            return
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        watcher = asyncio.create_task(self._watch(receive, task)) if watch is None else None
        if watch is not None:
            watch(self.client_left)
        streams = None
        if self.token is not None:
            streams = self.gateway.streams_by_token.setdefault(self.token.id, set())
            streams.add(self.end_for_revocation)
            if not self.gateway.tokens.is_valid(self.token.id):
                self.end_for_revocation()
        try:
            await self._forward_and_relay(request, send)
        except asyncio.CancelledError:
            if not (self._disconnected or self._ended is not None or self._stopped):
                raise
            # Ended on purpose (the client left, its token was revoked, the daemon is stopping) and answered
            # honestly: nothing for the server to report.
            task.uncancel()
        finally:
            if watcher is not None:
                watcher.cancel()
            if streams is not None:
                streams.discard(self.end_for_revocation)

    async def _forward_and_relay(self, request: UpstreamRequest, send: Send) -> None:
        outcome = self.outcome
        # 2. select and 3. forward
        try:
            upstream = await self._open(request)
        except asyncio.CancelledError:
            if self._ended is not None:
                await send_error(send, self._ended, self.request_id)
                outcome.status, outcome.error_code = self._ended.status, self._ended.code
            elif self._disconnected:
                outcome.status, outcome.error_code = CLIENT_CLOSED_REQUEST, "client_disconnected"
            elif self.gateway.shutting_down:
                # The daemon stops after its grace period, before any node answered: say so, as an answer.
                stopping = RequestRefused(
                    503,
                    "The gateway is shutting down and ended this request before a node answered; retry the request.",
                    "gateway_shutdown",
                    type="service_unavailable_error",
                )
                stopping.retry_after_s = 1.0
                await send_error(send, stopping, self.request_id)
                outcome.status, outcome.error_code = stopping.status, stopping.code
                self._stopped = True
            raise
        except (RoutingError, UpstreamError) as exc:
            await send_error(send, exc, self.request_id)
            if isinstance(exc, ModelNotFound | NoNodes):
                # A model no node serves is the client's word only: keep it out of the label set.
                outcome.model = ""
            outcome.status, outcome.error_code = exc.status, exc.code
            if isinstance(exc, UpstreamError):
                outcome.failures = exc.failures if isinstance(exc, FailoverExhausted) else [exc]
            return
        # 4. relay
        outcome.node, outcome.status = upstream.node_id, upstream.status_code
        outcome.failures = upstream.failures
        try:
            await relay(upstream, send, self.request_id, outcome, self.writer)
        except asyncio.CancelledError:
            if self._disconnected:
                outcome.error_code = "client_disconnected"
                logger.info("client disconnected; closed its request to node %s", upstream.node_id)
            elif upstream.sse:
                # The token was revoked, or the daemon is stopping (its grace ran out, or the stop was forced): end
                # the stream honestly, with one error event.
                ended = self._ended
                outcome.error_code = ended.code if ended is not None else "gateway_shutdown"
                await end_stream(send, sse_error_event(ended) if ended is not None else SHUTDOWN_EVENT)
                if ended is None:
                    self._stopped = True
                    logger.info(
                        "stream %s to node %s ended: the daemon stopped (its shutdown grace period ran out, or the "
                        "stop was forced)",
                        self.request_id,
                        upstream.node_id,
                    )
            raise
        finally:
            await upstream.aclose()

    async def _open(self, request: UpstreamRequest) -> UpstreamResponse:
        """3. forward. A request for a model nothing serves yet that a deployment starts on demand (scaled to
        zero: `ExpectedModel.wait_s`) first waits for a replica, counted as queued for the autoscaler; nothing
        reaches the client meanwhile, so a stream is not committed before the node's first token."""
        gateway = self.gateway
        try:
            return await gateway.forwarder.open(request)
        except (ModelNotFound, NoNodes, ModelUnavailable):
            expected = gateway.table.expected.get(request.model)
            if expected is None or expected.wait_s <= 0:
                raise
        await wait_for_replica(gateway, request.model, expected)
        return await gateway.forwarder.open(request)

    def end_for_revocation(self) -> None:
        """The request's invoke token was revoked or expired: end the request now (in-band for a stream)."""
        if self._ended is None and self._task is not None:
            token_id = self.token.id if self.token is not None else "?"
            self._ended = TokenRevoked(
                f"The invoke token {token_id} was revoked or expired; this request was ended.", token_id=token_id
            )
            self._task.cancel()

    def client_left(self) -> None:
        """The client left before the answer's end: end the request (its node's request is closed)."""
        if not self._disconnected and self._task is not None:
            self._disconnected = True
            self._task.cancel()

    async def _watch(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        while True:
            message: Message = await receive()
            if message["type"] == "http.disconnect":
                self._disconnected = True
                task.cancel()
                return
