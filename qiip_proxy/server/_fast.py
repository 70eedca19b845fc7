"""The inference paths answered in the HTTP server's protocol itself, ahead of the ASGI application.

uvicorn runs every request through its ASGI machinery: a `RequestResponseCycle` with an `asyncio.Event`, the scope's
copy of the app state, generic header checks at every send, the head and the body written apart, the ASGI layers
(`AllowedHosts`, `ProxyRoutes`) each a coroutine call per request, and a second task per inference request watching
for the client to leave. On one core that was about a fifth of an inference request's CPU (docs/performance.md).

`direct_protocol(base, route)` returns `base` (uvicorn's httptools protocol, as `_transport` and `_connection_cap`
extend it) answering a `POST` whose request target is exactly one of `route.paths` with a `DirectCycle`: the same
attributes the protocol, the transport limits and the server's shutdown read of uvicorn's cycle (`response_started`,
`response_complete`, `more_body`, `disconnected`, `keep_alive`, `message_event.set()`), with `receive` and `send` of
their own, written for what the inference path sends: the head is held until the body's first bytes and both go
out in one write; a client that leaves is reported to the request at once (`DirectCycle.watch`), without a task
waiting on `receive`; a stream's events may be written without ASGI messages (`write_body`, `drained`: the relay's
pump). Everything else (another method, a path with a query or percent-escapes, an upgrade, a Unix
socket's connection) goes to the ASGI application as before.

What a direct request keeps of uvicorn's behaviour: `Expect: 100-continue` answered at the first read of the body,
reading paused past `HIGH_WATER_LIMIT` bytes of unread body, sending paused while the transport's buffer is full,
keep-alive as HTTP/1.1 and the request say (`Connection: close` otherwise), chunked framing when the answer has no
`Content-Length`, header names and values checked before they are written, pipelined requests queued, and an
application error answered 500 (or the connection closed when the answer had begun), logged as uvicorn logs it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE, HttpToolsProtocol

__all__ = ["DirectCycle", "DirectRoute", "direct_protocol"]

logger = logging.getLogger("uvicorn.error")


class DirectRoute(Protocol):
    """What the protocol answers itself, and how."""

    @property
    def paths(self) -> frozenset[bytes]:
        """The request targets (exactly, as the client sent them) whose `POST` is answered directly."""

    def serve(self, scope: Scope, receive: Receive, send: Send, client: DirectCycle) -> Awaitable[None]:
        """Serve one request completely: its ASGI scope and channels, and `client` (`DirectCycle.watch`: the client's
        leaving; `write_body`, `drained`: an answer's body written without ASGI messages)."""


def _nothing() -> None:
    pass


class DirectCycle:
    """One request answered directly, as the protocol, the transport limits and the server see it: the surface of
    uvicorn's `RequestResponseCycle` they read, and ASGI `receive`/`send` written to the transport.

    Args:
        scope: the request's ASGI scope.
        protocol: the connection's protocol (its transport, flow control and default headers).
        route: what serves the request.
        keep_alive: whether the connection may serve another request after this one.
        expect_100_continue: the client waits for `100 Continue` before it sends the body.
    """

    __slots__ = (
        "_chunked",
        "_chunks",
        "_expected",
        "_head",
        "_left",
        "_route",
        "_size",
        "_waiter",
        "disconnected",
        "flow",
        "keep_alive",
        "message_event",
        "more_body",
        "on_response",
        "protocol",
        "response_complete",
        "response_started",
        "scope",
        "transport",
        "waiting_for_100_continue",
    )

    def __init__(
        self,
        scope: Scope,
        protocol: HttpToolsProtocol,
        route: DirectRoute,
        *,
        keep_alive: bool,
        expect_100_continue: bool,
    ) -> None:
        self.scope = scope
        self.protocol = protocol
        self._route = route
        self.transport: asyncio.Transport = protocol.transport
        self.flow: FlowControl = protocol.flow
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.disconnected = False
        self._chunks: list[bytes] = []
        self._size = 0
        self.more_body = True
        self.response_started = False
        self.response_complete = False
        self.on_response: Callable[[], None] = protocol.on_response_complete
        # The protocol and the limits call `cycle.message_event.set()` when body bytes come, the body ends, or the
        # client leaves: this cycle is its own event.
        self.message_event = self
        self._waiter: asyncio.Future[None] | None = None
        self._left: Callable[[], None] | None = None
        self._head: bytes | None = None
        self._chunked = False
        self._expected = 0

    # -- what the protocol calls ---------------------------------------------------------------------------------

    def feed(self, body: bytes) -> None:
        """Body bytes came (`on_body`)."""
        if self.response_complete:
            return
        self._chunks.append(body)
        self._size += len(body)
        if self._size > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        self.set()

    def set(self) -> None:
        """Something changed (`message_event.set()`): wake the read waiting for the body, and tell the request
        when its client left."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.disconnected and self._left is not None:
            left, self._left = self._left, None
            left()

    def watch(self, left: Callable[[], None]) -> None:
        """Call `left` once, when the client leaves before the answer's end (at once if it has left)."""
        if self.disconnected:
            left()
        elif not self.response_complete:
            self._left = left

    async def run_asgi(self, app: Any) -> None:
        """Serve the request through the protocol's direct route (`app`, uvicorn's pipeline entry, is unused)."""
        try:
            await self._route.serve(self.scope, self.receive, self.send, self)
        except BaseException as exc:
            logger.error("Exception in ASGI application\n", exc_info=exc)
            if not self.response_started:
                await self._send_500()
            else:
                self.transport.close()
        else:
            if not self.response_started and not self.disconnected:
                logger.error("ASGI callable returned without starting response.")
                await self._send_500()
            elif not self.response_complete and not self.disconnected:
                logger.error("ASGI callable returned without completing response.")
                self.transport.close()
        finally:
            self.on_response = _nothing
            self._left = None

    async def _send_500(self) -> None:
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", b"21"),
            (b"connection", b"close"),
        ]
        await self.send({"type": "http.response.start", "status": 500, "headers": headers})
        await self.send({"type": "http.response.body", "body": b"Internal Server Error", "more_body": False})

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Write a whole answer at once, head and body, without ASGI messages (what `send` does with a start and one
        body message).

        Raises:
            RuntimeError: an answer was started already, a header is invalid, or the body does not match its
                `Content-Length`.
        """
        if self.disconnected:
            return
        if self.response_started:
            raise RuntimeError("answer needs an answer not started yet.")
        self.response_started = True
        self.waiting_for_100_continue = False
        head = self._start(status, headers)
        if self._chunked:
            data = (b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)) if body else b"0\r\n\r\n"
        elif len(body) != self._expected:
            raise RuntimeError("Response content does not match Content-Length")
        else:
            data = body
        self.transport.write(head + data)
        self.response_complete = True
        self._left = None
        if not self.keep_alive:
            self.transport.close()
        self.on_response()

    def write_body(self, data: bytes) -> bool:
        """Write a piece of a started chunked answer's body, without an ASGI message (the relay's pump).

        Returns:
            Whether the client can take more now (False: its transport's buffer is full; `drained` waits).

        Raises:
            RuntimeError: the answer has not started, is not chunked, or has ended.
        """
        if self.disconnected:
            return True  # the request is being ended; nothing to write to
        if self._head is not None or not self._chunked or self.response_complete:
            raise RuntimeError("write_body needs a started chunked answer that has not ended.")
        if data:
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return not self.flow.write_paused

    async def drained(self) -> None:
        """Wait until the client's transport takes more (at once when it does, or when the client left)."""
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()

    # -- ASGI ----------------------------------------------------------------------------------------------------

    async def receive(self) -> Message:
        """The next piece of the body (`http.request`), or `http.disconnect` once the client left or the answer
        ended."""
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete and not self._chunks and self.more_body:
            self.flow.resume_reading()
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        chunks = self._chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._size = 0
        self.flow.resume_reading()
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def send(self, message: Message) -> None:
        """Write an answer's start (held until its first body bytes, so both go in one write) or a piece of its
        body.

        Raises:
            RuntimeError: the messages are out of order, a header is invalid, or the body does not match its
                `Content-Length` (as uvicorn raises them; the request then ends with 500 or a closed connection).
        """
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got '{kind}'.")
            self.response_started = True
            self.waiting_for_100_continue = False
            self._head = self._start(message["status"], message.get("headers", ()))
            return
        if self.response_complete:
            raise RuntimeError(f"Unexpected ASGI message '{kind}' sent, after response already completed.")
        if kind != "http.response.body":
            raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{kind}'.")
        body: bytes = message.get("body", b"")
        more_body: bool = message.get("more_body", False)
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more_body:
                data += b"0\r\n\r\n"
        else:
            if len(body) > self._expected:
                raise RuntimeError("Response content longer than Content-Length")
            self._expected -= len(body)
            data = body
        head = self._head
        if head is not None:
            self._head = None
            data = head + data
        if data:
            self.transport.write(data)
        if not more_body:
            if self._expected != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self._left = None
            if not self.keep_alive:
                self.transport.close()
            self.on_response()

    def _start(self, status: int, headers: Any) -> bytes:
        """The answer's status line and headers (uvicorn's default headers first), as uvicorn frames them."""
        content = [STATUS_LINE[status]]
        names: list[bytes] = []
        values: list[bytes] = []
        length: int | None = None
        chunked = closing = False
        for pairs in (self.protocol.server_state.default_headers, headers):
            for name, value in pairs:
                name = name.lower()
                names.append(name)
                values.append(value)
                if name == b"content-length":
                    if length is None and not chunked:
                        length = int(value.decode())
                elif name == b"transfer-encoding":
                    if value.lower() == b"chunked":
                        length = None
                        chunked = True
                elif name == b"connection" and b"close" in [token.lower().strip() for token in value.split(b",")]:
                    self.keep_alive = False
                    closing = True
                content += (name, b": ", value, b"\r\n")
        # Checked together: one search over every name, one over every value.
        if HEADER_RE.search(b"".join(names)):
            raise RuntimeError("Invalid HTTP header name.")
        if HEADER_VALUE_RE.search(b"".join(values)):
            raise RuntimeError("Invalid HTTP header value.")
        if not self.keep_alive and not closing:
            content.append(b"connection: close\r\n")
        if length is None and not chunked and status not in (204, 304):
            chunked = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self._chunked = chunked
        self._expected = length or 0
        return b"".join(content)


def direct_protocol(base: type[HttpToolsProtocol], route: DirectRoute) -> type[HttpToolsProtocol]:
    """`base` answering `route`'s paths itself (`DirectCycle`), every other request through the ASGI app.

    Args:
        base: uvicorn's `HttpToolsProtocol` (the transport limits and the connection cap subclass the result).
        route: the paths answered directly and the request path that serves them.

    Returns:
        The protocol class.
    """
    paths = route.paths

    class DirectProtocol(base):  # type: ignore[valid-type,misc]
        def on_headers_complete(self) -> None:
            parser = self.parser
            if (
                self.client is None
                or self.url not in paths
                or parser.get_method() != b"POST"
                or parser.should_upgrade()
                or self.limit_concurrency is not None
            ):
                super().on_headers_complete()
                return
            http_version = parser.get_http_version()
            scope = self.scope
            path = self.url.decode("ascii")
            scope["method"] = "POST"
            if http_version != "1.1":
                scope["http_version"] = http_version
            scope["path"] = self.root_path + path
            scope["raw_path"] = self.root_path.encode("ascii") + self.url
            scope["query_string"] = b""
            existing: Any = self.cycle  # type: ignore[has-type]  # (its base is a variable here)
            cycle: Any = DirectCycle(
                scope,
                self,
                route,
                keep_alive=http_version != "1.0" and parser.should_keep_alive(),
                expect_100_continue=self.expect_100_continue,
            )
            self.cycle = cycle
            if existing is None or existing.response_complete:
                self._start_asgi_task(cycle, self.app)
            else:
                self.flow.pause_reading()
                self.pipeline.appendleft((cycle, self.app))

        def on_body(self, body: bytes) -> None:
            cycle: Any = self.cycle
            if isinstance(cycle, DirectCycle):
                cycle.feed(body)
            else:
                super().on_body(body)

        def on_message_complete(self) -> None:
            cycle: Any = self.cycle
            if isinstance(cycle, DirectCycle):
                if not cycle.response_complete:
                    cycle.more_body = False
                    cycle.set()
            else:
                super().on_message_complete()

    return DirectProtocol
