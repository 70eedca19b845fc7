"""The cap on client connections, enforced when a connection is accepted, in every serving process.

uvicorn's own cap (`limit_concurrency`) is checked when a request's headers are in, not when a connection is
accepted: connections that never send a byte are all accepted, each holding a file descriptor, up to the open-file
limit. Node traffic and health probes then fail with "Too many open files", and every new request, `/admin`
included, gets 503 until the silent connections time out.

`capped_protocol` counts this process's client connections from the moment each is accepted (TCP only: the worker
processes' connections to the primary's Unix socket are not clients). At the cap (`server.max_client_connections`,
derived by default from the open-file limit, keeping room for node connections and probes: `_limits`):

- a new connection takes the place of the one that has waited longest with no request in the app: one that never
  sent a byte, an idle keep-alive connection, one whose headers are still coming. That one is closed (as Apache's
  event MPM closes idle keep-alive connections when it runs short; HTTP clients retry a request on an idle
  connection the server closed);
- when every connection has a request in progress, the new one is answered 503 and closed at once.

So idle or silent sockets can neither take the descriptors node traffic needs nor keep a real request out. What
was closed or refused is logged at most once every `LOG_EVERY_S`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["LOG_EVERY_S", "capped_protocol"]

logger = logging.getLogger("qiip.proxy")

LOG_EVERY_S = 10.0
"""The least time between two log lines about connections closed or refused at the cap."""

_REFUSAL = b"The server is at its connection limit; retry in a moment."


def capped_protocol(base: type[HttpToolsProtocol], *, max_connections: int) -> type[HttpToolsProtocol]:
    """`base` (uvicorn's httptools protocol, or a subclass) with client connections capped at accept time.

    Args:
        base: the protocol class to cap (`_transport.guarded_protocol`'s).
        max_connections: client connections this process holds at once.

    Returns:
        The protocol class (pass it as uvicorn's `http=`); one per server, as its count is the server's.
    """
    # Connections with no request in the app, the one that has waited longest first.
    waiting: OrderedDict[CappedProtocol, None] = OrderedDict()
    held = 0
    closed = refused = 0
    logged_at = -LOG_EVERY_S

    def note(*, made_room: bool) -> None:
        nonlocal closed, refused, logged_at
        if made_room:
            closed += 1
        else:
            refused += 1
        now = time.monotonic()
        if now - logged_at >= LOG_EVERY_S:
            logger.warning(
                "at the cap of %d client connections: %d idle connection(s) closed to make room, %d new one(s) "
                "refused with 503 (every connection had a request in progress)",
                max_connections,
                closed,
                refused,
            )
            closed = refused = 0
            logged_at = now

    class CappedProtocol(base):  # type: ignore[valid-type,misc]
        _counted_at_cap = False

        def connection_made(self, transport: asyncio.Transport) -> None:
            nonlocal held
            super().connection_made(transport)
            if self.client is None or transport.is_closing():
                return  # a Unix socket's (a worker's), or one `base` refused already
            if held >= max_connections:
                if not waiting:
                    self._refuse_at_cap()
                    note(made_room=False)
                    return
                longest, _ = waiting.popitem(last=False)
                longest._uncount_at_cap()
                longest.transport.close()
                note(made_room=True)
            held += 1
            self._counted_at_cap = True
            waiting[self] = None

        def on_headers_complete(self) -> None:
            waiting.pop(self, None)
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            idle = not self.pipeline
            super().on_response_complete()
            if idle and self._counted_at_cap and not self.transport.is_closing():
                waiting[self] = None

        def connection_lost(self, exc: Exception | None) -> None:
            self._uncount_at_cap()
            super().connection_lost(exc)

        def _uncount_at_cap(self) -> None:
            nonlocal held
            if self._counted_at_cap:
                self._counted_at_cap = False
                held -= 1
                waiting.pop(self, None)

        def _refuse_at_cap(self) -> None:
            head = (
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"content-length: %d\r\nconnection: close\r\nretry-after: 1\r\n" % len(_REFUSAL)
            )
            own = b"".join(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers)
            self.transport.write(head + own + b"\r\n" + _REFUSAL)
            self.transport.close()

    return CappedProtocol
