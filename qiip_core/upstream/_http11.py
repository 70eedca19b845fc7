"""The node client's connections: one asyncio protocol per connection to a node, parsing the node's answer with
httptools (llhttp, in C) as its bytes arrive, and the answer as the caller reads it (`NodeResponse`). The pool
that holds the connections and sends requests on them is `_pool`.

An answer's status and headers are awaited once; its body is buffered as it comes (the connection stops reading
past `HIGH_WATER_BYTES` until the reader takes it), and ends as HTTP says: the declared length, the last chunk, or
the connection's close for a body that declares neither. An informational answer (1xx) is skipped. The connection
goes back to the pool once the answer's last byte is in (unless either side said `Connection: close`), so a caller
that stops reading a whole answer loses nothing; an answer abandoned before its end closes its connection, and the
node sees the client leave. Bytes that come while no answer is expected close the connection.

Errors are this package's own, translated at its boundary by `map_transport_error`:

    NodeHttpError
    ├── NodeConnectError      the connection could not be made: refused, unreachable, not resolved, every
    │                         address refused by the allowlist, TLS failed (the OS error is its `__cause__`)
    ├── NodeConnectTimeout    no connection within the time allowed, the wait for the pool included (a
    │                         `TimeoutError` too)
    ├── NodeDisconnected      the connection was closed or reset before the answer's headers were in: a pooled
    │                         connection the node had closed is the usual cause (`is_stale_connection`)
    ├── NodeAnswerMalformed   the bytes are not an HTTP/1.1 answer
    └── NodeAnswerCut         the connection ended before the answer's body did
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

import httptools

__all__ = [
    "HIGH_WATER_BYTES",
    "ConnectionOwner",
    "NodeAnswerCut",
    "NodeAnswerMalformed",
    "NodeConnectError",
    "NodeConnectTimeout",
    "NodeConnection",
    "NodeDisconnected",
    "NodeHttpError",
    "NodeResponse",
    "SendProgress",
]

HIGH_WATER_BYTES = 256 * 1024
"""Body bytes a response holds unread before its connection stops reading (TCP then holds the node back)."""


class NodeHttpError(Exception):
    """The base of the node client's errors (drawn in the module docstring)."""


class NodeConnectError(NodeHttpError):
    """The connection to the node could not be made; the OS or TLS error is the `__cause__`."""


class NodeConnectTimeout(NodeHttpError, TimeoutError):
    """No connection to the node within the time allowed (the wait for a free one in the pool included)."""


class NodeDisconnected(NodeHttpError):
    """The connection was closed or reset before the node's answer had its headers."""


class NodeAnswerMalformed(NodeHttpError):
    """The node's bytes are not an HTTP/1.1 answer."""


class NodeAnswerCut(NodeHttpError):
    """The connection ended before the node's answer's body did."""


@dataclass(slots=True)
class SendProgress:
    """Whether one request has reached its node: once it has a connection (new, or taken from the pool), it is
    written to it at once.

    Attributes:
        sent: the request was given a connection to the node, and written to it.
    """

    sent: bool = False


class ConnectionOwner(Protocol):
    """What a connection tells its pool (`_pool.NodeConnections`)."""

    def put_back(self, connection: NodeConnection) -> None:
        """The connection finished an answer and may serve the next request."""

    def forget(self, connection: NodeConnection) -> None:
        """The connection closed (either side)."""


_NOTED = frozenset({b"content-type", b"content-encoding", b"content-length"})
"""Headers the response reads of every answer, kept apart as they are parsed (`NodeResponse.header`)."""
_NOTED_TEXT = frozenset(name.decode() for name in _NOTED)


class NodeResponse:
    """A node's answer: its status and headers (in once the response is returned), and its body as it comes.

    Attributes:
        status: the HTTP status.
        raw_headers: the headers as the node sent them, names in their own case, in order.
    """

    __slots__ = (
        "_chunks",
        "_connection",
        "_ended",
        "_error",
        "_held",
        "_lower",
        "_noted",
        "_paused",
        "_sink",
        "_size",
        "_waiter",
        "raw_headers",
        "status",
    )

    def __init__(self, connection: NodeConnection) -> None:
        self._connection: NodeConnection | None = connection
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._lower: dict[str, str] | None = None
        self._noted: dict[bytes, bytes] = {}
        self._chunks: list[bytes] = []
        self._size = 0
        self._ended = False
        self._error: NodeHttpError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._held = False
        self._sink: Callable[[bytes], None] | None = None

    def header(self, name: str) -> str | None:
        """The value of header `name` (lower case; the first when the node sent it twice), or None."""
        if name in _NOTED_TEXT:
            value = self._noted.get(name.encode())
            return value.decode("latin-1") if value is not None else None
        lower = self._lower
        if lower is None:
            lower = self._lower = {}
            for key, value in reversed(self.raw_headers):
                lower[key.decode("latin-1").lower()] = value.decode("latin-1")
        return lower.get(name)

    @property
    def content_type(self) -> str:
        """The media type of `Content-Type` in lower case, without its parameters (`application/octet-stream` when
        there is none, as RFC 9110 §8.3 lets a recipient assume)."""
        value = self.header("content-type")
        if not value:
            return "application/octet-stream"
        return value.split(";", 1)[0].strip().lower()

    async def readany(self) -> bytes:
        """The body bytes in since the last read, waiting for some when there are none yet.

        Returns:
            The bytes (joined), or b"" at the body's end.

        Raises:
            NodeAnswerCut, NodeAnswerMalformed: the answer broke off (after the bytes before the break were read).
        """
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._ended:
                return b""
            connection = self._connection
            loop = connection.loop if connection is not None else asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._size = 0
        if self._paused:
            self._paused = False
            connection = self._connection
            if connection is not None and connection.transport is not None:
                connection.transport.resume_reading()
        return data

    def stream_to(self, sink: Callable[[bytes], None]) -> None:
        """Hand the body to `sink` as it comes (the bytes in so far first), not to `readany`: once per read of the
        connection, every piece of it joined. Reading resumes if it was held. Until `unsink`, `pumped` says when the
        body ends or `sink` called `hold`."""
        self._sink = sink
        self._held = False
        self._deliver()
        if self._paused and not self._held:
            self._paused = False
            connection = self._connection
            if connection is not None and connection.transport is not None:
                connection.transport.resume_reading()

    def unsink(self) -> None:
        """Back to `readany`: body pieces are held for it again."""
        self._sink = None

    def hold(self) -> None:
        """Stop reading the node's connection until the next `stream_to` (the sink's reader cannot take more now),
        and end the `pumped` wait with False."""
        if self._held or self._ended:
            return
        self._held = True
        connection = self._connection
        if not self._paused and connection is not None and connection.transport is not None:
            self._paused = True
            connection.transport.pause_reading()
        self._wake()

    async def pumped(self) -> bool:
        """Wait while `stream_to`'s sink takes the body: True once it has ended, False when the sink held it.

        Raises:
            NodeAnswerCut, NodeAnswerMalformed: the answer broke off (the sink had every byte before the break).
        """
        while True:
            if self._error is not None:
                raise self._error
            if self._ended:
                return True
            if self._held:
                return False
            connection = self._connection
            loop = connection.loop if connection is not None else asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def at_eof(self) -> bool:
        """Whether the body has ended and every byte of it has been read."""
        return self._ended and not self._chunks

    @property
    def whole(self) -> bool:
        """Whether the whole body is in (read or not)."""
        return self._ended

    def release(self) -> None:
        """Done with an answer read to its end (its connection is already back in the pool); else as `close`."""
        if not self._ended:
            self.close()

    def close(self) -> None:
        """Abandon the answer: an answer not in whole closes its connection, so the node sees the client leave.
        Idempotent."""
        connection, self._connection = self._connection, None
        if connection is not None and not self._ended:
            connection.abandon()

    # -- fed by the connection ----------------------------------------------------------------------------------

    def _feed(self, parts: list[bytes]) -> None:
        self._chunks += parts
        self._size += sum(map(len, parts))
        if self._sink is not None:
            return  # delivered once the connection's read is parsed (`_deliver`)
        if self._size > HIGH_WATER_BYTES and not self._paused:
            connection = self._connection
            if connection is not None and connection.transport is not None:
                self._paused = True
                connection.transport.pause_reading()
        self._wake()

    def _deliver(self) -> None:
        """Hand what came in the last read to the sink (`stream_to`), when there is one."""
        sink = self._sink
        chunks = self._chunks
        if sink is not None and chunks:
            self._chunks = []
            self._size = 0
            sink(chunks[0] if len(chunks) == 1 else b"".join(chunks))

    def _end(self) -> None:
        self._deliver()
        self._ended = True
        connection, self._connection = self._connection, None
        if self._paused:
            # The connection goes on to another answer: it must read again.
            self._paused = False
            if connection is not None and connection.transport is not None:
                connection.transport.resume_reading()
        self._wake()

    def _fail(self, error: NodeHttpError) -> None:
        self._deliver()
        if not self._ended and self._error is None:
            self._error = error
            self._connection = None
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class NodeConnection(asyncio.Protocol):
    """One connection to a node, with the answer in progress (one at a time: no pipelining).

    Args:
        pool: where it goes back after an answer, and says it closed.
        origin: the pool's key of the node it is connected to.
        pooled: kept for the next request after an answer (else closed after it).
    """

    def __init__(self, pool: ConnectionOwner, origin: Hashable, *, pooled: bool) -> None:
        self.pool = pool
        self.origin = origin
        self.pooled = pooled
        self.transport: asyncio.Transport | None = None
        # The body's pieces as llhttp parses them (a chunked stream: one per chunk, often one per event), gathered by
        # a list's own `append` rather than a Python callback per piece, and handed to the answer once per read.
        self._parts: list[bytes] = []
        self.on_body: Callable[[bytes], None] = self._parts.append
        self.parser = httptools.HttpResponseParser(self)
        self.response: NodeResponse | None = None
        self._headers: asyncio.Future[None] | None = None
        self._informational = False
        self._delimited = False
        self.idle_since = 0.0
        self.closed = False
        self.loop = asyncio.get_running_loop()
        self.lost: asyncio.Future[None] = self.loop.create_future()

    # -- the request -----------------------------------------------------------------------------------------------

    async def send(self, head: bytes, body: bytes) -> NodeResponse:
        """Write one request and wait for its answer's headers.

        Raises:
            NodeDisconnected: the connection is closing, or was closed before the headers came.
            NodeAnswerMalformed: the answer is not HTTP.
        """
        transport = self.transport
        if transport is None or transport.is_closing():
            self._close()
            raise NodeDisconnected("the connection to the node was closed before the request was written")
        response = self.response = NodeResponse(self)
        self._informational = self._delimited = False
        waiter = self._headers = self.loop.create_future()
        if len(body) < 65536:
            transport.write(head + body)
        else:
            transport.writelines((head, body))
        try:
            await waiter
        except BaseException:
            # A timeout, the client leaving, the connection lost: the node must see it, and the connection is spent
            # (unless the answer came whole meanwhile and the connection went on to another request).
            if self.response is response:
                self.abandon()
            raise
        return response

    def abandon(self) -> None:
        """The answer in progress is not wanted any more: close the connection."""
        self.response = None
        self._close()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            if self.transport is not None:
                self.transport.close()

    # -- asyncio.Protocol ------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:
            # Bytes nobody asked for (after an answer's end, or while idle): this connection cannot be trusted.
            self._close()
            return
        response = self.response
        parts = self._parts
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            parts.clear()
            self._failed(NodeAnswerMalformed(f"the node's answer is not valid HTTP/1.1: {exc}"))
            self._close()
            return
        if parts:
            response._feed(parts)
            parts.clear()
        # A stream being pumped gets this read's body in one piece (one write to the client, not one per chunk).
        response._deliver()

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself; `connection_lost` says what that ended

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        response = self.response
        if response is not None:
            why = f": {exc}" if exc is not None else ""
            if self._headers is not None:
                self._failed(NodeDisconnected(f"the node closed the connection before its answer's headers{why}"))
            elif exc is None and not self._delimited and response.status not in (204, 304):
                # A body that declares neither a length nor chunks ends with the connection (RFC 9112 §6.3).
                self.response = None
                response._end()
            else:
                self._failed(NodeAnswerCut(f"the connection to the node ended in the middle of its answer{why}"))
        if not self.lost.done():
            self.lost.set_result(None)

    # -- httptools callbacks ---------------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self.response
        if response is not None:
            response.raw_headers.append((name, value))
            lower = name.lower()
            if lower in _NOTED:
                response._noted.setdefault(lower, value)
                if lower == b"content-length":
                    self._delimited = True
            elif lower == b"transfer-encoding" and b"chunked" in value.lower():
                self._delimited = True

    def on_headers_complete(self) -> None:
        response = self.response
        if response is None:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            # `100 Continue` and the like: the answer comes after it.
            self._informational = True
            response.raw_headers.clear()
            response._noted.clear()
            self._delimited = False
            return
        response.status = status
        waiter, self._headers = self._headers, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        response, self.response = self.response, None
        if response is not None:
            if self._parts:
                response._feed(self._parts)
                self._parts.clear()
            response._end()
        if self.pooled and self.parser.should_keep_alive():
            self.pool.put_back(self)
        else:
            self._close()

    def _failed(self, error: NodeHttpError) -> None:
        response, self.response = self.response, None
        waiter, self._headers = self._headers, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        elif response is not None:
            response._fail(error)
