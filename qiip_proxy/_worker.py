"""One worker process (`server.workers`): the client API over the primary's view of the fleet.

A worker serves the inference paths and `GET /v1/models` itself, from a routing table that mirrors the
primary's (`_workers`: the control channel), counting its reservations on the shared board; every other
request (the admin API, after the same credential check the primary makes; `/health`; `/metrics`; the chat
page) is passed to the primary over its Unix socket and its answer relayed back as it comes (event streams
included). The requests it finishes, its counters, the prefixes it routed and its requests waiting for a first
replica (scale from zero) go to the primary every `FLUSH_S`; the prefixes the other processes routed come back from
it as often.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qiip_core import QiipError
from qiip_core._errors import safe_text
from qiip_core._logging import configure_logging
from qiip_core.auth import TokenStore, create_token_store
from qiip_core.config import Settings
from qiip_core.deployments import DemandMeter
from qiip_core.routing import DEFAULT_COLUMNS, Admission, InFlightBoard, RoutingTable
from qiip_core.upstream import HOP_BY_HOP_HEADERS
from qiip_proxy._app import add_error_handlers, direct_route, wrap_serving
from qiip_proxy._control import (
    ControlError,
    Expected,
    Hello,
    NodeDelete,
    NodePut,
    Ready,
    Report,
    Shared,
    TokensChanged,
    decode,
    encode,
)
from qiip_proxy._errors import RequestRefused, body_too_large, error_response
from qiip_proxy._gateway import AttachedTokens, auth_throttle, forwarder_for, routing_table, sweep_removed
from qiip_proxy._metrics import Accounted, CounterKey, GatewayMetrics
from qiip_proxy._scope import admin_body_limit, header, logged_path
from qiip_proxy._workers import (
    ADMIN_SOCKET,
    BOARD_FILE,
    CONTROL_SOCKET,
    PEER_HEADER,
    keep_shared,
    learn_shared,
    take_shared,
)
from qiip_proxy.layers._http import HeadAsGet
from qiip_proxy.routes._client_api import router as client_router
from qiip_proxy.server._limits import client_connection_cap, raise_open_file_limit
from qiip_proxy.server._server import Server, server_config

__all__ = [
    "FLUSH_S",
    "HEARTBEAT_S",
    "PRIMARY_TIMEOUT_S",
    "READY_TIMEOUT_S",
    "WorkerGateway",
    "WorkerMetrics",
    "run_worker",
]

logger = logging.getLogger("qiip.proxy")

FLUSH_S = 0.1
"""How often a worker sends the primary its finished requests and counters."""

HEARTBEAT_S = 0.5
"""The longest a worker stays silent on its control channel: with nothing else to send, it says it is alive (the
primary replaces a worker silent for `_workers.SILENT_S`)."""

PRIMARY_TIMEOUT_S = 60.0
"""How long a request a worker passes on waits for the primary's answer to begin (a hung primary gets 503
`primary_unavailable`)."""

READY_TIMEOUT_S = 30.0
"""How long a starting worker waits for the primary's fleet before it gives up (and is started again)."""

_HOP_BY_HOP = HOP_BY_HOP_HEADERS - {b"host", b"content-length"}
"""Headers not passed between client and primary: the connection's own. The client's `Host` goes on (the primary's
pages build URLs from it); a request's `Content-Length` is httpx's to set, and an answer's stays true of the bytes
relayed as they came."""


_OWN_HEADERS = frozenset({b"x-request-id", b"date", b"server"})
"""Headers the worker's own layers put on every answer (uvicorn's `Date`), never relayed from the primary's."""


def _relayed(name: bytes) -> bool:
    """Whether a header of the primary's answer is relayed: not a hop-by-hop one, nor one the worker's own layers
    add to every answer (`_OWN_HEADERS`; CORS headers when `server.cors_allow_origins` is set)."""
    name = name.lower()
    return name not in _HOP_BY_HOP and name not in _OWN_HEADERS and not name.startswith(b"access-control-")


def run_worker(settings: Settings, listener: socket.socket, runtime_dir: Path, row: int, workers: int) -> None:
    """A worker process's entry point: serve on `listener` until SIGTERM/SIGINT or until the primary is gone.

    Args:
        settings: the primary's settings.
        listener: the listening socket the primary bound.
        runtime_dir: the primary's runtime directory (`_workers.create_runtime_dir`).
        row: this worker's row on the board (1 to `workers - 1`).
        workers: serving processes in all.
    """
    configure_logging(level=settings.logging.level, format=settings.logging.format)
    board = InFlightBoard(runtime_dir / BOARD_FILE, rows=workers, columns=DEFAULT_COLUMNS, row=row)
    gateway = WorkerGateway(settings, board=board)
    keep_shared(gateway)
    runtime = _WorkerRuntime(gateway, runtime_dir, row)
    max_clients = client_connection_cap(settings, raise_open_file_limit())
    server = Server(gateway, server_config(runtime.app, settings, max_clients, direct=direct_route(gateway)))
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:
        pass  # Ctrl-C in a terminal reaches every process of the group: uvicorn stopped on it, as it should.
    finally:
        board.close()


class WorkerGateway:
    """What a worker serves the client API with: the request path's parts alone (`_types.ServingGateway`), 13
    attributes where the primary's `Gateway` holds the whole fleet runtime in 33 (registry, health checks, local
    nodes, provisioning, deployments, catalog, QUADS, telemetry, the journal), none of which runs in a worker.

    Args:
        settings: the primary's settings.
        board: the board counting requests in flight over every serving process, at this worker's row (the
            primary assigns the columns; they come with the fleet).

    Raises:
        ConfigError: an attached profile's token file is not private.
    """

    def __init__(self, settings: Settings, *, board: InFlightBoard) -> None:
        self.settings = settings
        self.table = routing_table(settings, board=board, primary=False)
        self.admission = Admission(self.table, settings.admission)
        """The per-model bound on requests in flight (`[admission]`), over every process (the board)."""
        self.attached_tokens = AttachedTokens(settings, self.table)
        self.forwarder = forwarder_for(settings, self.table, self.attached_tokens.headers_for)
        self.demand_meter = DemandMeter()
        """This worker's requests waiting for a first replica, which it reports to the primary."""
        self.metrics = WorkerMetrics(self.table)
        """Its finished requests and counters, kept for the primary (`_control.Report`)."""
        self.tokens: TokenStore = create_token_store(settings)
        self.admin_throttle = auth_throttle(settings)
        """Wrong admin credentials per client address, learned from the primary (which checks them)."""
        self.client_throttle = auth_throttle(settings)
        """Wrong invoke tokens per client address."""
        self.parse_gate = asyncio.Semaphore(1)
        """Held while a large request body is measured and parsed (`_parse.read_request`)."""
        # Streams running on each invoke token, ended at once when the token is revoked or expires.
        self.streams_by_token: dict[str, set[Callable[[], None]]] = {}
        self.shutting_down = False

    @property
    def tokens_required(self) -> bool:
        """True when clients must present an invoke token (`auth.client_tokens = "required"`)."""
        return self.settings.auth.client_tokens == "required"

    def wake_controller(self) -> None:
        """Nothing here: the deployment controller runs in the primary, which this worker's next report wakes (its
        waiting requests, `Report.queued`)."""

    def begin_shutdown(self) -> None:
        """The server stopped accepting connections: requests that wait for a node end now."""
        self.shutting_down = True

    def force_shutdown(self) -> None:
        """A worker runs no other serving process: nothing to pass on."""

    def token_revoked(self, token_id: str) -> None:
        """End every stream running on the invoke token `token_id` (the token store calls this)."""
        for end in list(self.streams_by_token.pop(token_id, ())):
            end()


class WorkerMetrics(GatewayMetrics):
    """A worker's metrics: each finished request is kept for the primary (`take`), not recorded here.

    Args:
        table: the worker's routing table.
        on_finished: as `GatewayMetrics`'s (called by the primary, which records the requests).
    """

    def __init__(self, table: RoutingTable, *, on_finished: Callable[[str, float | None], None] | None = None) -> None:
        super().__init__(table, on_finished=on_finished)
        self.finished: list[Accounted] = []

    def record(self, accounted: Accounted) -> None:
        self.finished.append(accounted)

    def take(self) -> list[Accounted]:
        """The requests finished since the last call."""
        finished, self.finished = self.finished, []
        return finished


class _WorkerRuntime:
    """The worker's app and what runs beside it: the fleet from the primary, the metrics to it."""

    def __init__(self, gateway: WorkerGateway, runtime_dir: Path, row: int) -> None:
        self.gateway = gateway
        self.row = row
        self.runtime_dir = runtime_dir
        self.control_path = runtime_dir / CONTROL_SOCKET
        self._primary_pid = os.getppid()
        settings = gateway.settings
        self.primary = _PrimaryPassage(
            runtime_dir / ADMIN_SOCKET,
            max_body_bytes=settings.server.max_body_bytes,
            max_admin_body_bytes=settings.admin.max_body_bytes,
            max_restore_bytes=settings.admin.max_restore_bytes,
        )
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._writer: asyncio.StreamWriter | None = None
        self._sent_counters: dict[CounterKey, float] = {}
        self._sent_queued: dict[str, int] = {}
        self._sent_at = 0.0
        self._refreshes: set[asyncio.Task[None]] = set()

        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            await self.startup()
            try:
                yield
            finally:
                await self.shutdown()

        api = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        api.state.gateway = gateway
        api.include_router(client_router)
        add_error_handlers(api)
        # The admin API's credentials are the primary's to check: one throttle per client address for all.
        self.app: ASGIApp = wrap_serving(gateway, _Dispatch(HeadAsGet(api), self.primary), admin_gate=False)

    async def startup(self) -> None:
        """Start the token store, read the whole fleet from the primary, start the sweep and the metrics flush.

        Raises:
            RuntimeError: the primary's fleet did not arrive within `READY_TIMEOUT_S`.
        """
        gateway = self.gateway
        await gateway.tokens.start(gateway.token_revoked)
        try:
            reader, self._writer = await asyncio.open_unix_connection(str(self.control_path), limit=16 * 1024 * 1024)
        except (ConnectionError, FileNotFoundError):
            # The primary died before this worker connected (SIGKILL while it started): nobody else removes the
            # runtime directory.
            await self._remove_runtime_dir_if_orphaned()
            raise RuntimeError(f"worker {self.row}: the primary process is gone; not starting") from None
        self._writer.write(encode(Hello(row=self.row)))
        self._tasks = [
            asyncio.create_task(self._follow(reader), name="qiip-worker-fleet"),
            asyncio.create_task(self._flush_every(), name="qiip-worker-flush"),
            asyncio.create_task(sweep_removed(gateway.table), name="qiip-sweep"),
        ]
        try:
            await asyncio.wait_for(self._ready.wait(), READY_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(f"worker {self.row}: the primary sent no fleet within {READY_TIMEOUT_S:g} s") from None
        logger.info("worker %d serving (pid %d): %d node(s)", self.row, os.getpid(), len(gateway.table))

    async def shutdown(self) -> None:
        """Send the last finished requests, then close the control channel and every client."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._flush()
        if self._writer is not None:
            with contextlib.suppress(ConnectionError):
                await self._writer.drain()
            self._writer.close()
        await self.primary.aclose()
        await self.gateway.tokens.aclose()
        await self.gateway.forwarder.aclose()

    async def _follow(self, reader: asyncio.StreamReader) -> None:
        """Apply the primary's fleet messages; when the primary is gone, shut this worker down."""
        table = self.gateway.table
        try:
            while line := await reader.readline():
                match decode(line):
                    case NodePut(node=node, source=source, column=column, slots=slots):
                        table.apply_put(node, source=source)
                        table.set_column(node.id, column)
                        state = table.get(node.id)
                        if state is not None:
                            state.slots = slots
                    case Shared() as shared:
                        learn_shared(self.gateway, shared)
                    case NodeDelete(node_id=node_id):
                        table.apply_delete(node_id)
                    case Expected(models=models):
                        table.expected = dict(models)
                    case TokensChanged():
                        self._refreshes.add(task := asyncio.create_task(self._refresh_tokens()))
                        task.add_done_callback(self._refreshes.discard)
                    case Ready():
                        self._ready.set()
                    case other:
                        raise ControlError(f"the primary sent {other.kind!r}, which only a worker sends")
        except (ConnectionError, ValueError) as exc:
            # ValueError: a ControlError, or a line longer than the stream's limit.
            logger.error("worker %d: the control channel failed: %s", self.row, exc)
        logger.warning("worker %d: the primary process is gone; shutting down", self.row)
        await self._remove_runtime_dir_if_orphaned()
        os.kill(os.getpid(), signal.SIGTERM)

    async def _remove_runtime_dir_if_orphaned(self) -> None:
        """Remove the runtime directory when the primary died without doing so (SIGKILL, a crash): its workers do.
        A dead parent's children are handed to another process just after its files close: wait up to 2 s for
        that before deciding."""
        for _ in range(40):
            if os.getppid() != self._primary_pid:
                break
            await asyncio.sleep(0.05)
        if os.getppid() != self._primary_pid:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    async def _refresh_tokens(self) -> None:
        try:
            await self.gateway.tokens.refresh()
        except QiipError as exc:
            logger.warning("worker %d: the token store could not be read: %s", self.row, exc.message)

    async def _flush_every(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            self._flush()

    def _flush(self) -> None:
        """Send the primary a `Report` of what changed since the last one; with nothing new, an empty one (the
        heartbeat: this worker's loop still runs) once `HEARTBEAT_S` has passed."""
        metrics = self.gateway.metrics
        finished = metrics.take()
        shared = take_shared(self.gateway)
        counters = metrics.counted()
        if counters == self._sent_counters:
            changed = None
        else:
            self._sent_counters = counters
            changed = tuple(counters.items())
        queued = self.gateway.demand_meter.local_queued()
        if queued == self._sent_queued:
            queued_changed = None
        else:
            queued_changed = self._sent_queued = queued
        now = time.monotonic()
        empty = not finished and shared is None and changed is None and queued_changed is None
        if empty and now - self._sent_at < HEARTBEAT_S:
            return
        if self._writer is not None and not self._writer.is_closing():
            report = Report(requests=tuple(finished), counters=changed, queued=queued_changed, shared=shared)
            self._writer.write(encode(report))
            self._sent_at = now


class _Dispatch:
    """The client API's read paths (`/v1/…`) to the worker's own app; every other path to the primary."""

    def __init__(self, api: ASGIApp, primary: ASGIApp) -> None:
        self.api = api
        self.primary = primary

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/v1/"):
            await self.api(scope, receive, send)
        else:
            await self.primary(scope, receive, send)


class _PrimaryPassage:
    """An ASGI app that passes each request to the primary's app over its Unix socket, with the client's address
    (`PEER_HEADER`), and relays the answer as it comes, until it ends or the client leaves. The request's body
    goes on as it arrives, its size counted on the way: this process never holds one whole.

    Args:
        socket_path: the primary's `admin.sock`.
        max_body_bytes: the largest request body passed on (`server.max_body_bytes`); a larger one gets 413.
        max_admin_body_bytes: the same for `/admin/*` (`admin.max_body_bytes`).
        max_restore_bytes: the same for a backup's restore (`admin.max_restore_bytes`), streamed on as well.
    """

    def __init__(
        self, socket_path: Path, *, max_body_bytes: int, max_admin_body_bytes: int, max_restore_bytes: int
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self.max_admin_body_bytes = max_admin_body_bytes
        self.max_restore_bytes = max_restore_bytes
        # One connection per request in progress, event streams included: no pool bound to wait on.
        self.client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(socket_path)),
            timeout=httpx.Timeout(None, connect=5.0, write=PRIMARY_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    async def aclose(self) -> None:
        """Close the connections to the primary."""
        await self.client.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"].startswith("/admin"):
            limit, setting = admin_body_limit(
                scope, max_body_bytes=self.max_admin_body_bytes, max_restore_bytes=self.max_restore_bytes
            )
            too_large = body_too_large(limit, setting)
        else:
            too_large = body_too_large(self.max_body_bytes, "server.max_body_bytes")
            limit = self.max_body_bytes
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await error_response(too_large)(scope, receive, send)
            return
        target = scope.get("raw_path") or scope["path"].encode()
        if scope["query_string"]:
            target += b"?" + scope["query_string"]
        headers = [(k, v) for k, v in scope["headers"] if k not in _HOP_BY_HOP and k != PEER_HEADER]
        client = scope.get("client")
        if client:
            headers.append((PEER_HEADER, str(client[0]).encode("latin-1")))
        sent = asyncio.Event()

        async def body() -> AsyncIterator[bytes]:
            # The body goes on as it comes, never held whole: a request no one has authenticated yet costs this
            # process a chunk at a time, and the primary decides (its gate reads no body it refuses).
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _PassageStopped(None)
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise _PassageStopped(too_large)
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    sent.set()
                    return

        has_body = declared is not None or header(scope, b"transfer-encoding") is not None
        if not has_body:
            sent.set()
        request = self.client.build_request(
            scope["method"],
            "http://primary" + target.decode("latin-1"),
            headers=headers,
            content=body() if has_body else None,
        )
        answer = asyncio.ensure_future(self.client.send(request, stream=True))
        uploaded = asyncio.ensure_future(sent.wait())
        try:
            # The body as fast as the client sends it (its deadline is `server.body_timeout_s`; a write the
            # primary does not take within PRIMARY_TIMEOUT_S fails), then the answer's head within
            # PRIMARY_TIMEOUT_S (its body, such as an event stream, may take any time).
            await asyncio.wait((answer, uploaded), return_when=asyncio.FIRST_COMPLETED)
            response = await asyncio.wait_for(answer, PRIMARY_TIMEOUT_S)
        except _PassageStopped as stopped:
            if stopped.refusal is not None:
                await error_response(stopped.refusal)(scope, receive, send)
            return
        except (httpx.HTTPError, TimeoutError) as exc:
            why = str(exc) or f"no answer within {PRIMARY_TIMEOUT_S:g} s"
            logger.warning(
                "%s %s: the primary process did not answer: %s", scope["method"], logged_path(scope), safe_text(why)
            )
            refused = RequestRefused(
                503,
                "The daemon's primary process, which serves this path, is not answering (it may be stopping); "
                "retry in a moment.",
                "primary_unavailable",
                type="api_error",
            )
            refused.retry_after_s = 1.0
            await error_response(refused)(scope, receive, send)
            return
        finally:
            uploaded.cancel()
            if not answer.done():
                answer.cancel()
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [(k, v) for k, v in response.headers.raw if _relayed(k)],
                }
            )
            relay = asyncio.ensure_future(self._relay(response, send))
            left = asyncio.ensure_future(_disconnected(receive))
            await asyncio.wait((relay, left), return_when=asyncio.FIRST_COMPLETED)
            for task in (relay, left):
                task.cancel()
            await asyncio.gather(relay, left, return_exceptions=True)
        finally:
            await response.aclose()

    @staticmethod
    async def _relay(response: httpx.Response, send: Send) -> None:
        try:
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            logger.warning("the primary's answer broke off: %s", exc)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _PassageStopped(Exception):
    """A request body stopped on its way to the primary: over the limit (`refusal`, answered to the client), or its
    client left (`refusal` None)."""

    def __init__(self, refusal: RequestRefused | None) -> None:
        super().__init__(refusal.message if refusal is not None else "the client left")
        self.refusal = refusal


async def _disconnected(receive: Receive) -> None:
    """Return when the client has gone (`http.disconnect`)."""
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return
