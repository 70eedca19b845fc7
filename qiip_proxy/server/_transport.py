"""Transport limits on client connections, in the HTTP/1.1 server itself (uvicorn's httptools protocol).

uvicorn bounds neither a request's headers (a 64 MiB header is accepted), nor the time they may take (a
connection that sends half a request line stays open for ever), nor a body's pace, nor how many connections
one address holds. `guarded_protocol` returns uvicorn's `HttpToolsProtocol` with these limits added:

- headers over `max_header_bytes` (request line included) are answered 431 and the connection closed
  (RFC 6585 §5), counted as the bytes arrive: httptools keeps an unfinished header value (or URL) to itself
  until it ends, so a value that never ends is refused once the bytes received for the request's head pass
  the limit, without waiting for it;
- a request whose headers are not complete `header_timeout_s` after its first byte (or after the connection
  opened) is answered 408 and closed (RFC 9110 §15.5.9); an idle keep-alive connection is uvicorn's
  `timeout_keep_alive`;
- a body not complete `body_timeout_s` after its headers ends the same way (408 when nothing was answered
  yet);
- an address holding `max_connections_per_address` connections gets 503 on its next one.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["guarded_protocol"]


def guarded_protocol(
    *,
    max_header_bytes: int,
    header_timeout_s: float,
    body_timeout_s: float,
    max_connections_per_address: int,
    base: type[HttpToolsProtocol] = HttpToolsProtocol,
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with header, deadline and per-address limits (pass it as `http=`).

    Args:
        base: the protocol to add them to: uvicorn's, or one answering some paths itself (`_fast`).
        max_header_bytes: the longest request line and headers together, in bytes.
        header_timeout_s: how long a request's headers may take, in seconds.
        body_timeout_s: how long a request's body may take once its headers are in, in seconds.
        max_connections_per_address: connections one client address may hold at once.

    Returns:
        The protocol class.
    """
    per_address: Counter[str] = Counter()

    # A connection's deadline is checked by one timer of its own, every `tick_s`: a request costs a clock
    # read, not a timer of its own (about 3 us less per request).
    tick_s = max(0.05, min(header_timeout_s, body_timeout_s) / 4)

    class GuardedProtocol(base):  # type: ignore[valid-type,misc]
        _refused = False
        _header_bytes = 0
        # Bytes received while a request's head is incomplete (None: no head in progress), and the size of the
        # chunk being parsed.
        _head_received: int | None = None
        _feeding = 0
        # When the request in progress (its headers, then its body) must be in; None between requests.
        _due: float | None = None
        _ticker: asyncio.TimerHandle | None = None
        _address: str | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            address = self.client[0] if self.client else None
            if address is not None:
                if per_address[address] >= max_connections_per_address:
                    self._refuse(HTTPStatus.SERVICE_UNAVAILABLE, "Too many connections from this address.")
                    return
                per_address[address] += 1
                self._address = address
            self._due = self.loop.time() + header_timeout_s
            self._ticker = self.loop.call_later(tick_s, self._tick)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._ticker is not None:
                self._ticker.cancel()
                self._ticker = None
            if self._address is not None:
                per_address[self._address] -= 1
                if per_address[self._address] <= 0:
                    del per_address[self._address]
                self._address = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            self._feeding = len(data)
            super().data_received(data)
            if self._head_received is not None and not self._refused:
                # The parser holds an unfinished header to itself: bound what it holds by the bytes fed to it.
                self._head_received += len(data)
                if self._head_received > max_header_bytes:
                    self._refuse(
                        HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                        f"The request's headers are larger than {max_header_bytes} bytes.",
                    )

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes = 0
            # The chunk this request began in may hold a previous request's end: counted from the next one.
            self._head_received = -self._feeding
            self._due = self.loop.time() + header_timeout_s

        def on_url(self, url: bytes) -> None:
            self._header_bytes += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_bytes += len(name) + len(value) + 4
            if self._header_bytes > max_header_bytes:
                if not self._refused:
                    self._refuse(
                        HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                        f"The request's headers are larger than {max_header_bytes} bytes.",
                    )
                return
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._head_received = None
            if self._refused:
                return
            self._due = self.loop.time() + body_timeout_s
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            self._due = None
            if not self._refused:
                super().on_message_complete()

        def _tick(self) -> None:
            self._ticker = None
            if self._refused or self.transport.is_closing():
                return
            if self._due is not None and self.loop.time() >= self._due:
                self._expired()
                return
            self._ticker = self.loop.call_later(tick_s, self._tick)

        def _expired(self) -> None:
            self._due = None
            cycle: Any = self.cycle
            if cycle is not None and not cycle.response_complete:
                # The body is late: the request cannot be served whole.
                cycle.disconnected = True
                cycle.message_event.set()
                if cycle.response_started:
                    self.transport.close()
                    return
            self._refuse(HTTPStatus.REQUEST_TIMEOUT, "The request was not received in time.")

        def _refuse(self, status: HTTPStatus, message: str) -> None:
            self._refused = True
            self._due = None
            if not self.transport.is_closing():
                body = message.encode()
                head = (
                    f"HTTP/1.1 {status.value} {status.phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n"
                ).encode()
                # uvicorn's own headers (its `Date`), as on every other answer.
                own = b"".join(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers)
                self.transport.write(head + own + b"\r\n" + body)
                self.transport.close()

    return GuardedProtocol
