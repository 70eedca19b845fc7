"""The backend itself: a scripted inference node on 127.0.0.1, on its own event loop in a daemon thread.

A test drives it from any thread: it queues behaviours, sets the health and default answers, stops and starts
listening, and waits on the requests it recorded. The loop thread runs the connections (`_http`) and asks the
backend which behaviour answers each request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

from tests.support.fault_backend._answers import Completion
from tests.support.fault_backend._exchange import Behaviour, ClientGone, RequestRecord
from tests.support.fault_backend._http import Connection, TrackingProtocol
from tests.support.fault_backend._payloads import error_body
from tests.support.fault_backend._status import Json, Status

logger = logging.getLogger("qiip.tests.fault_backend")

INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
"""The POST paths answered by the queue or the default behaviour."""

_SHUTDOWN_TIMEOUT_S = 10.0


class FaultBackend:
    """A scripted inference node on 127.0.0.1, on its own event loop in a daemon thread.

    It listens as soon as it is built; use it as a context manager (or call `close()`). All methods are
    thread-safe, but must not be called from inside a behaviour, which runs on the backend's own loop.

    Args:
        model: the model the node serves, listed by `/v1/models` and named in responses.

    Raises:
        OSError: no port could be bound on 127.0.0.1.
    """

    def __init__(self, *, model: str = "fault-model") -> None:
        self.model = model
        self._cond = threading.Condition()
        self._queue: deque[tuple[Behaviour, float]] = deque()
        self._records: list[RequestRecord] = []
        now = time.monotonic()
        self._health: tuple[Behaviour, float] = (Json(200, {"status": "ok"}), now)
        self._default: tuple[Behaviour, float] = (Completion(), now)
        self._serials = itertools.count(1)
        self._connection_ids = itertools.count(1)
        # Loop-thread state below.
        self._port = 0
        self._server: asyncio.Server | None = None
        self._held: socket.socket | None = None
        self._transports: set[asyncio.Transport] = set()
        self._connections: set[Connection] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="fault-backend", daemon=True)
        self._thread.start()
        try:
            self._call(self._listen())
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> FaultBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<FaultBackend {self.url} model={self.model!r}>"

    @property
    def port(self) -> int:
        """The TCP port, the same for the backend's whole life."""
        return self._port

    @property
    def url(self) -> str:
        """The base URL, `http://127.0.0.1:PORT`."""
        return f"http://127.0.0.1:{self._port}"

    @property
    def health(self) -> Behaviour:
        """How `GET /health` answers; `Json(200, {"status": "ok"})` until set. Setting it restarts its clock."""
        with self._cond:
            return self._health[0]

    @health.setter
    def health(self, behaviour: Behaviour) -> None:
        with self._cond:
            self._health = (behaviour, time.monotonic())

    @property
    def default(self) -> Behaviour:
        """How inference requests are answered when the queue is empty; `Completion()` until set."""
        with self._cond:
            return self._default[0]

    @default.setter
    def default(self, behaviour: Behaviour) -> None:
        with self._cond:
            self._default = (behaviour, time.monotonic())

    @property
    def requests(self) -> list[RequestRecord]:
        """A snapshot of every request received since the start or the last `reset()`, oldest first."""
        with self._cond:
            return [replace(record) for record in self._records]

    def push(self, *behaviours: Behaviour) -> None:
        """Queue behaviours for the next inference requests, one each, before the default applies again.

        Args:
            behaviours: answers for the next requests, in order.
        """
        now = time.monotonic()
        with self._cond:
            self._queue.extend((behaviour, now) for behaviour in behaviours)

    def reset(self) -> None:
        """Forget the queued behaviours and the recorded requests (health and default stay as they are)."""
        with self._cond:
            self._queue.clear()
            self._records.clear()

    def wait_for_requests(self, n: int, timeout_s: float = 30.0, *, path: str | None = None) -> list[RequestRecord]:
        """Wait until at least `n` requests (to `path`, when given, query string ignored) have been received.

        Args:
            n: how many requests to wait for.
            timeout_s: seconds to wait at most (a bound for a busy machine, not an expectation).
            path: count only requests to this path, for example "/v1/chat/completions".

        Returns:
            A snapshot of the matching requests.

        Raises:
            TimeoutError: fewer than `n` matching requests arrived in time.
        """

        def matching() -> list[RequestRecord]:
            return [r for r in self._records if path is None or r.path.split("?", 1)[0] == path]

        with self._cond:
            if not self._cond.wait_for(lambda: len(matching()) >= n, timeout_s):
                got = len(matching())
                raise TimeoutError(f"The backend received {got} of the {n} awaited requests in {timeout_s} s.")
            return [replace(record) for record in matching()]

    def wait_for_disconnect(self, index: int | None = None, timeout_s: float = 30.0) -> float:
        """Wait until the client of a request goes away while the backend is answering it.

        Args:
            index: position in `requests`; None (the default) is the latest inference request at each check, so
                the gateway's health probes arriving meanwhile do not count.
            timeout_s: seconds to wait at most (a bound for a busy machine, not an expectation).

        Returns:
            The `time.monotonic()` of the disconnect.

        Raises:
            TimeoutError: no such request arrived, or its client did not disconnect, in time.
        """

        def disconnected_at() -> float | None:
            if index is None:
                inference = [r for r in self._records if r.path.split("?", 1)[0] in INFERENCE_PATHS]
                return inference[-1].disconnected_at if inference else None
            try:
                return self._records[index].disconnected_at
            except IndexError:
                return None

        with self._cond:
            if not self._cond.wait_for(lambda: disconnected_at() is not None, timeout_s):
                which = "the latest inference request" if index is None else f"request {index}"
                raise TimeoutError(f"The client of {which} did not disconnect within {timeout_s} s.")
            at = disconnected_at()
            assert at is not None
            return at

    def stop_listening(self, *, drop_connections: bool = False) -> None:
        """Close the listening socket, so new connections are refused; open connections carry on. The port stays
        bound (not listening) until `start_listening()`, so no other server can take it meanwhile.

        Args:
            drop_connections: also close every open connection (cleanly), like a node that went away.

        Raises:
            RuntimeError: the backend is closed.
        """
        self._call(self._stop_listening(drop_connections=drop_connections))

    def start_listening(self) -> None:
        """Listen again on the same port after `stop_listening()`; nothing happens if already listening.

        Raises:
            RuntimeError: the backend is closed.
            OSError: the port was taken by someone else meanwhile (only where it could not be held).
        """
        self._call(self._listen())

    def close(self) -> None:
        """Stop the server: close every connection, cancel its tasks, close the loop and join the thread.

        Calling it again does nothing.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(_SHUTDOWN_TIMEOUT_S)
            except Exception:
                logger.exception("The fault backend did not shut down cleanly.")
            # The loop thread cancels what is left, then closes the loop.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_SHUTDOWN_TIMEOUT_S)

    # -- Called on the loop thread ----------------------------------------------------------------------

    def _next_serial(self) -> int:
        return next(self._serials)

    def _pick(self, method: str, path: str) -> tuple[Behaviour, float]:
        with self._cond:
            if path == "/health" and method == "GET":
                return self._health
            if path == "/v1/models" and method == "GET":
                model = {"id": self.model, "object": "model", "owned_by": "fault"}
                return Json(200, {"object": "list", "data": [model]}), 0.0
            if path in INFERENCE_PATHS and method == "POST":
                return self._queue.popleft() if self._queue else self._default
        if path in INFERENCE_PATHS or path in ("/health", "/v1/models"):
            return Status(405, error_body(405, f"{method} is not allowed on {path}.")), 0.0
        return Status(404, error_body(404, f"There is no {path} on this backend.")), 0.0

    def _add(self, record: RequestRecord) -> None:
        with self._cond:
            self._records.append(record)
            self._cond.notify_all()

    def _update(self, record: RequestRecord, **changes: Any) -> None:
        with self._cond:
            for name, value in changes.items():
                if name == "disconnected_at" and record.disconnected_at is not None:
                    continue
                setattr(record, name, value)
            self._cond.notify_all()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            try:
                pending = asyncio.all_tasks(self._loop)
                for task in pending:
                    task.cancel()
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                # Connections accepted after `_shutdown()` ran, whose `connection_made` came only now.
                for transport in list(self._transports):
                    transport.abort()
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            finally:
                self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        if self._closed or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("The fault backend is closed; create a new one.")
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(_SHUTDOWN_TIMEOUT_S)

    async def _listen(self) -> None:
        if self._server is not None:
            return
        self._release_port()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: TrackingProtocol(self, loop), host="127.0.0.1", port=self._port, reuse_address=True
        )
        self._port = self._server.sockets[0].getsockname()[1]

    async def _stop_listening(self, *, drop_connections: bool) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
            self._hold_port()
        if drop_connections:
            for conn in list(self._connections):
                await conn.close()

    def _hold_port(self) -> None:
        """Keep the port bound, not listening, while the backend refuses: connections to it are refused, and no
        other process can listen on it meanwhile (a port closed outright may be handed to the next server that
        binds port 0, which would then answer in the backend's place)."""
        held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            held.bind(("127.0.0.1", self._port))
        except OSError:
            held.close()
            return
        self._held = held

    def _release_port(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

    async def _shutdown(self) -> None:
        await self._stop_listening(drop_connections=False)
        self._release_port()
        for conn in list(self._connections):
            conn.closed_by_backend = True
            conn.gone.set()
        for transport in list(self._transports):
            transport.abort()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        conn = Connection(self, reader, writer, next(self._connection_ids))
        self._connections.add(conn)
        try:
            await conn.serve()
        except ClientGone:
            pass
        except asyncio.CancelledError:
            # Only _shutdown() cancels handlers. Ending normally keeps Python 3.11's stream callback from
            # logging an error for a cancelled task (https://github.com/python/cpython/issues/113538).
            pass
        except Exception:
            logger.exception("The fault backend failed on connection %d; closing it.", conn.id)
        finally:
            self._connections.discard(conn)
            self._handlers.discard(task)
            await conn.close()
