"""The server plumbing: one HTTP/1.1 connection on plain asyncio streams, its request parser and its reader task.

No web framework: a framework would buffer, reframe or smooth over the bytes and timing these tests control.
Each connection has one reader task for its whole life. It buffers what the client sends (the parser reads from
that buffer) and so notices at once when the client goes away, even while a behaviour sleeps or streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tests.support.fault_backend._exchange import Exchange, RequestRecord
from tests.support.fault_backend._payloads import dumps, error_body, parse_json

if TYPE_CHECKING:
    from tests.support.fault_backend._backend import FaultBackend

logger = logging.getLogger("qiip.tests.fault_backend")

MAX_HEAD_BYTES = 64 * 1024
"""A request line plus headers longer than this is rejected with 431."""

MAX_BODY_BYTES = 64 * 1024 * 1024
"""A request body longer than this is rejected with 413."""

_READ_BYTES = 64 * 1024
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(rb"HTTP/1\.[01]")
_TARGET = re.compile(rb"[\x21-\x7e]+")


class TrackingProtocol(asyncio.StreamReaderProtocol):
    """Streams protocol that registers its transport, so shutdown can close connections whose handler
    task has not started yet (they would otherwise leak a socket and a ResourceWarning)."""

    def __init__(self, backend: FaultBackend, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(asyncio.StreamReader(loop=loop), backend._serve_connection, loop=loop)
        self._backend = backend
        self._transport_seen: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if self._backend._closed:
            # Accepted while the backend shuts down (a health probe of the daemon, say): after `_shutdown()` has
            # aborted the transports it knew of. Closed here, or its socket is left to the garbage collector.
            transport.abort()
            return
        self._transport_seen = transport
        self._backend._transports.add(transport)
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport_seen is not None:
            self._backend._transports.discard(self._transport_seen)
        super().connection_lost(exc)


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Incomplete(Exception):
    """The client closed the connection in the middle of a request."""


@dataclass(slots=True)
class ParsedRequest:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


class Connection:
    """One client connection: a reader task that buffers input and notices EOF, and the request loop."""

    def __init__(
        self, backend: FaultBackend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn_id: int
    ) -> None:
        self.backend = backend
        self.reader = reader
        self.writer = writer
        self.id = conn_id
        self.buffer = bytearray()
        self.eof = False
        self.gone = asyncio.Event()
        """Set when the client closed or reset the connection, or the backend closed it."""
        self.closed_by_backend = False
        self.active: Exchange | None = None
        """The exchange whose response is in progress, whose record a disconnect goes to."""
        self._data = asyncio.Event()
        self._pump_task = asyncio.create_task(self._pump())

    async def serve(self) -> None:
        while True:
            try:
                request = await self._read_request()
            except Incomplete:
                logger.debug("Connection %d closed in the middle of a request.", self.id)
                return
            except BadRequest as exc:
                logger.warning("The fault backend rejected a malformed request on connection %d: %s", self.id, exc)
                await self._reject(exc)
                return
            if request is None:
                return
            if not await self._answer(request):
                return

    async def close(self) -> None:
        """Close the connection cleanly, stop the reader task and wait for the socket to close."""
        if self.writer.transport.is_closing() and self._pump_task.done():
            return
        self.closed_by_backend = True
        self.gone.set()
        self._pump_task.cancel()
        await asyncio.gather(self._pump_task, return_exceptions=True)
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()

    async def _answer(self, request: ParsedRequest) -> bool:
        record = RequestRecord(
            method=request.method,
            path=request.target,
            headers=request.headers,
            body=request.body,
            json=parse_json(request.body),
            received_at=time.monotonic(),
            connection=self.id,
        )
        self.backend._add(record)
        behaviour, set_at = self.backend._pick(request.method, request.target.split("?", 1)[0])
        exchange = Exchange(self, record, set_at=set_at, keep_alive=request.keep_alive)
        self.active = exchange
        try:
            if self.gone.is_set():
                # The client left while its request was being read to the end.
                exchange._client_left()
                return False
            await behaviour.respond(exchange)
        finally:
            self.active = None
        return exchange._reusable and not self.gone.is_set()

    async def _pump(self) -> None:
        try:
            while data := await self.reader.read(_READ_BYTES):
                self.buffer += data
                self._data.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self.eof = True
            self._data.set()
            if not self.closed_by_backend:
                if self.active is not None:
                    self.active._client_left()
                self.gone.set()

    async def _more(self) -> None:
        """Wait for more input; raise `Incomplete` when no more will come."""
        if self.eof:
            raise Incomplete
        self._data.clear()
        await self._data.wait()

    async def _read_until(self, separator: bytes, limit: int) -> bytes:
        start = 0
        while (found := self.buffer.find(separator, start)) < 0:
            if len(self.buffer) > limit:
                raise BadRequest(f"No {separator!r} within {limit} bytes.", 431 if limit == MAX_HEAD_BYTES else 400)
            start = max(0, len(self.buffer) - len(separator) + 1)
            await self._more()
        data = bytes(self.buffer[:found])
        del self.buffer[: found + len(separator)]
        return data

    async def _read_exactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            await self._more()
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    async def _read_request(self) -> ParsedRequest | None:
        # Between requests, stray CRLFs are ignored (RFC 9112, section 2.2); EOF here is a clean close.
        while True:
            while self.buffer[:2] == b"\r\n":
                del self.buffer[:2]
            if self.buffer and self.buffer != b"\r":
                break
            if self.eof:
                return None
            await self._more()
        head = await self._read_until(b"\r\n\r\n", MAX_HEAD_BYTES)
        request_line, *header_lines = head.split(b"\r\n")
        parts = request_line.split(b" ")
        if (
            len(parts) != 3
            or not _TOKEN.fullmatch(parts[0])
            or not _TARGET.fullmatch(parts[1])
            or not _VERSION.fullmatch(parts[2])
        ):
            raise BadRequest(f"Malformed request line {request_line[:100]!r}.")
        method, target, version = (part.decode("latin-1") for part in parts)
        headers: dict[str, str] = {}
        for line in header_lines:
            name, colon, value = line.partition(b":")
            if not colon or not _TOKEN.fullmatch(name) or b"\r" in value or b"\n" in value:
                raise BadRequest(f"Malformed header line {line[:100]!r}.")
            key = name.decode("latin-1").lower()
            text = value.strip(b" \t").decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        connection = {token.strip() for token in headers.get("connection", "").lower().split(",")}
        keep_alive = "keep-alive" in connection if version == "HTTP/1.0" else "close" not in connection
        if headers.get("expect", "").lower() == "100-continue":
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = await self._read_body(headers)
        return ParsedRequest(method, target, headers, body, keep_alive)

    async def _read_body(self, headers: dict[str, str]) -> bytes:
        if "transfer-encoding" in headers:
            codings = [coding.strip().lower() for coding in headers["transfer-encoding"].split(",")]
            if codings[-1] != "chunked":
                raise BadRequest(f"Unsupported request Transfer-Encoding {headers['transfer-encoding']!r}.")
            return await self._read_chunked()
        if "content-length" in headers:
            values = {value.strip() for value in headers["content-length"].split(",")}
            value = values.pop()
            if values or not value.isdigit():
                raise BadRequest(f"Invalid Content-Length {headers['content-length']!r}.")
            if int(value) > MAX_BODY_BYTES:
                raise BadRequest(f"The body of {value} bytes exceeds {MAX_BODY_BYTES}.", 413)
            return await self._read_exactly(int(value))
        return b""

    async def _read_chunked(self) -> bytes:
        body = bytearray()
        while True:
            size_line = await self._read_until(b"\r\n", 1024)
            size_text = size_line.split(b";", 1)[0].strip()
            if not size_text or not all(c in b"0123456789abcdefABCDEF" for c in size_text):
                raise BadRequest(f"Malformed chunk size {size_line[:100]!r}.")
            size = int(size_text, 16)
            if size == 0:
                while await self._read_until(b"\r\n", MAX_HEAD_BYTES):
                    pass  # trailer fields are read and dropped
                return bytes(body)
            if len(body) + size > MAX_BODY_BYTES:
                raise BadRequest(f"The chunked body exceeds {MAX_BODY_BYTES} bytes.", 413)
            body += await self._read_exactly(size)
            if await self._read_exactly(2) != b"\r\n":
                raise BadRequest("A chunk is not followed by CRLF.")

    async def _reject(self, exc: BadRequest) -> None:
        body = dumps(error_body(exc.status, str(exc), error_type="invalid_request_error"))
        reason = http.HTTPStatus(exc.status).phrase
        head = (
            f"HTTP/1.1 {exc.status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.writer.write(head.encode("latin-1") + body)
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.drain()
