"""What passes between the server and a behaviour: the request's record, and the exchange a behaviour answers through.

`Exchange` is also where the connection faults live: `reset()` aborts with a TCP RST, `close()` sends a FIN
after whatever was written, and every wait and write notices at once when the client has gone away.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import http
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tests.support.fault_backend._payloads import lower_names

if TYPE_CHECKING:
    from tests.support.fault_backend._http import Connection


@dataclass(slots=True)
class RequestRecord:
    """One request the backend received. `FaultBackend.requests` hands out copies, so they never change.

    Attributes:
        method: the request method, for example `POST`.
        path: the request target as sent, query string included.
        headers: the request headers, names lower-cased; repeated headers are joined with ", ".
        body: the request body, de-chunked when it came with `Transfer-Encoding: chunked`.
        json: the body parsed as JSON, or None when it is empty or not JSON.
        received_at: `time.monotonic()` when the whole request had been read.
        disconnected_at: `time.monotonic()` when the client went away while the backend was still answering
            (or delaying its answer); None when it did not.
        completed: True once the whole response went out as a well-formed HTTP message; False for a response
            cut short by a scripted fault or by the client leaving.
        connection: serial number (from 1) of the TCP connection that carried the request, to tell keep-alive
            reuse from new connections.
    """

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    json: Any | None
    received_at: float
    disconnected_at: float | None = None
    completed: bool = False
    connection: int = 0


class ClientGone(Exception):
    """The connection is gone: the client closed or reset it (which is recorded), or the backend closed it.

    Raised by `Exchange` waits and writes; a behaviour lets it propagate.
    """


class Exchange:
    """One request being answered: the handle a `Behaviour` writes its response through.

    A response is either whole (`send_response()`) or streamed (`start_stream()`, `send()` per write,
    `end_stream()`), or cut short with `reset()` or `close()`. Every wait and write raises `ClientGone` as
    soon as the client has gone away.

    Attributes:
        request: the request being answered.
        model: the model the backend serves.
        port: the backend's port.
        set_at: `time.monotonic()` when the behaviour was assigned or pushed.
        serial: a number unique to this request on this backend, for response ids.
    """

    def __init__(self, conn: Connection, record: RequestRecord, *, set_at: float, keep_alive: bool) -> None:
        self._conn = conn
        self._record = record
        self.request = replace(record)
        self.model = conn.backend.model
        self.port = conn.backend.port
        self.set_at = set_at
        self.serial = conn.backend._next_serial()
        self._keep_alive = keep_alive
        self._chunked = False
        self._head_sent = False
        self._reusable = False  # the response went out in full and the connection may carry another request

    @property
    def api_path(self) -> str:
        """The request path without its query string."""
        return self.request.path.split("?", 1)[0]

    @property
    def payload(self) -> dict[str, Any]:
        """The request body as a JSON object, or an empty dict when it is not one."""
        return self.request.json if isinstance(self.request.json, dict) else {}

    async def sleep(self, seconds: float) -> None:
        """Wait, but stop as soon as the client goes away.

        Args:
            seconds: how long to wait; zero or less only checks the connection.

        Raises:
            ClientGone: the client went away before or during the wait.
        """
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await self._conn.gone.wait()
        if self._conn.gone.is_set():
            raise ClientGone

    async def wait_for_client_to_leave(self) -> None:
        """Wait until the client closes or resets the connection (or the backend shuts down)."""
        await self._conn.gone.wait()

    async def send_response(self, status: int, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        """Send a whole response with a Content-Length.

        Args:
            status: the status code.
            body: the body, sent in the same write as the head.
            headers: extra headers; they override the defaults (Content-Length included, to fake a bad one).

        Raises:
            ClientGone: the client went away.
        """
        merged = {"content-length": str(len(body))}
        merged.update(lower_names(headers))
        head = self._head(status, merged)
        await self._write(head + body, last=True)

    async def start_stream(self, status: int, headers: Mapping[str, str] | None = None, *, chunked: bool) -> None:
        """Send the head of a streamed response.

        Args:
            status: the status code.
            headers: extra headers; they override the framing headers.
            chunked: True for `Transfer-Encoding: chunked`; False for a body that ends when the connection
                closes (the response then carries `Connection: close`).

        Raises:
            ClientGone: the client went away.
        """
        self._chunked = chunked
        merged = {"transfer-encoding": "chunked"} if chunked else {"connection": "close"}
        merged.update(lower_names(headers))
        await self._write(self._head(status, merged))

    async def send(self, data: bytes) -> None:
        """Send one body write of a streamed response: one HTTP chunk when chunked, else the bytes as they are.

        An empty write is skipped when chunked, since an empty chunk would end the body.

        Raises:
            ClientGone: the client went away.
        """
        if self._chunked:
            if not data:
                return
            data = b"%x\r\n%b\r\n" % (len(data), data)
        await self._write(data)

    async def end_stream(self) -> None:
        """End a streamed response properly: the final chunk when chunked, else a clean close.

        Raises:
            ClientGone: the client went away.
        """
        if self._chunked:
            await self._write(b"0\r\n\r\n", last=True)
        else:
            self._complete()
            await self.close()

    def reset(self) -> None:
        """Abort the connection with a TCP RST (SO_LINGER 0), whatever was sent so far."""
        self._conn.closed_by_backend = True
        self._conn.gone.set()
        sock = self._conn.writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._conn.writer.transport.abort()

    async def close(self) -> None:
        """Close the connection cleanly (a FIN) after what was sent so far, without ending the response."""
        await self._conn.close()

    def _head(self, status: int, headers: Mapping[str, str]) -> bytes:
        if self._head_sent:
            raise RuntimeError("The response head was already sent; a behaviour can send it only once.")
        self._head_sent = True
        if not self._keep_alive:
            headers = {**headers, "connection": "close"}
        if headers.get("connection", "").lower() == "close":
            self._keep_alive = False
        try:
            reason = http.HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
        lines = [f"HTTP/1.1 {status} {reason}"]
        lines.extend(f"{name}: {value}" for name, value in headers.items())
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _write(self, data: bytes, *, last: bool = False) -> None:
        if self._conn.gone.is_set() or self._conn.writer.transport.is_closing():
            raise ClientGone
        if last:
            # Recorded before the bytes leave: a client that has read the whole response (on another
            # thread) must already find its request completed.
            self._complete()
        self._conn.writer.write(data)
        try:
            await self._conn.writer.drain()
        except (ConnectionError, OSError) as exc:
            if not self._conn.closed_by_backend:
                self._conn.backend._update(self._record, completed=False, disconnected_at=time.monotonic())
            raise ClientGone from exc

    def _complete(self) -> None:
        self._reusable = self._keep_alive
        self._conn.backend._update(self._record, completed=True)
        self._conn.active = None

    def _client_left(self) -> None:
        if self._conn.active is self and not self._conn.closed_by_backend:
            self._conn.backend._update(self._record, disconnected_at=time.monotonic())


class Behaviour(abc.ABC):
    """How the backend answers one request. Subclasses are frozen dataclasses, so one value can be reused."""

    @abc.abstractmethod
    async def respond(self, exchange: Exchange) -> None:
        """Answer the request through `exchange`.

        Raises:
            ClientGone: the client went away (the connection is then closed without further ado).
        """
