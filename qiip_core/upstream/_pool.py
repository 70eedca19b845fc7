"""The pool of connections to every node, and the requests the gateway sends on them (`NodeConnections.post`).

The gateway sends every node the same kind of request, a POST whose body it holds whole. A general client
(aiohttp's request and response objects, multidicts and URL objects, its connector's bookkeeping) cost about a third
of the gateway's CPU per relayed request (docs/performance.md); this one does what node traffic needs:

- one pool for all nodes, keyed by origin (scheme, host, port): at most `upstream.max_connections` connections open
  in all (a request waits for one up to `upstream.pool_timeout_s`; an idle connection to another node is closed to
  make room), idle ones reused newest first, closed once idle for `upstream.keepalive_expiry_s`, at most
  `upstream.max_keepalive_connections` of them kept;
- a request that finds an idle connection writes its head and body at once, without a timer;
- otherwise it connects: a host name is resolved in a thread and its addresses checked against the endpoint
  allowlist (`EndpointPolicy.allows_resolved`; an IP literal is not resolved), each address tried in turn within
  `upstream.connect_timeout_s`, all of it (the wait for the pool included) within `pool_timeout_s +
  connect_timeout_s`; `https` is verified against the system's CA store, as aiohttp's default context was.

The head carries `Host`, `Content-Length`, the caller's headers, `Accept: */*` when the caller gave none, and
`Connection: close` on a connection outside the pool; a header or path that would end its line early is refused
before anything is sent.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import ssl
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from qiip_core.config import UpstreamSettings
from qiip_core.nodes import EndpointPolicy
from qiip_core.upstream._http11 import (
    NodeConnectError,
    NodeConnection,
    NodeConnectTimeout,
    NodeResponse,
    SendProgress,
)

__all__ = ["NodeConnections"]

_BAD_HEADER = re.compile(r"[\r\n\x00]")
"""What no request header name or value may hold (it would end the header, or the head, early)."""


@dataclass(frozen=True, slots=True)
class _Origin:
    """Where a node is reached: the pool's key."""

    host: str
    """The host name or address to connect to (an IPv6 address without brackets)."""
    port: int
    tls: bool
    host_header: str
    """The `Host` header's value: the host, and the port unless it is the scheme's default."""
    literal: bool
    """`host` is an IP address (never resolved)."""


def _origin(url: str) -> _Origin:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise NodeConnectError(f"the node's URL {url!r} is not an http or https URL with a host")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    host = parts.hostname
    try:
        ipaddress.ip_address(host)
        literal = True
    except ValueError:
        literal = False
    shown = f"[{host}]" if ":" in host else host
    default = port == (443 if tls else 80)
    return _Origin(host, port, tls, shown if default else f"{shown}:{port}", literal)


class NodeConnections:
    """The pool of connections to every node, and the requests sent on them.

    Args:
        settings: the pool's bounds and timeouts (`upstream.*`).
        policy: the endpoint allowlist a host name's addresses are checked against when connecting; None checks
            nothing.
        tls: the TLS context of `https` nodes; by default the system's CA store and host name checks, loaded (in a
            thread) at the first `https` connection.
    """

    def __init__(
        self, settings: UpstreamSettings, *, policy: EndpointPolicy | None = None, tls: ssl.SSLContext | None = None
    ) -> None:
        self.settings = settings
        self.policy = policy
        # Per node URL: its origin, and the head's first lines.
        self._origins: dict[str, tuple[_Origin, str]] = {}
        self._idle: dict[Hashable, list[NodeConnection]] = {}
        self._idle_count = 0
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._all: set[NodeConnection] = set()
        self._tls = tls
        self._sweeper: asyncio.TimerHandle | None = None

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Sequence[tuple[str, str]],
        progress: SendProgress | None = None,
        *,
        fresh: bool = False,
    ) -> NodeResponse:
        """Send a POST and return once the answer's headers are in.

        Args:
            url: the node's URL (its endpoint and the path).
            body: the request's body, sent with its `Content-Length`.
            headers: the request's headers (`Host` and `Content-Length` are the client's; `Accept: */*` is added
                when none is given).
            progress: marked once the request has a connection (and is written to it at once), so a caller that
                gives up can tell whether the node had the request.
            fresh: send on a new connection, closed after the answer, outside the pool's count.

        Returns:
            The answer, headers in; read its body, then `release()` or `close()` it.

        Raises:
            NodeConnectError, NodeConnectTimeout: no connection could be made.
            NodeDisconnected: the connection closed before the answer's headers (a pooled one the node had closed).
            NodeAnswerMalformed: the answer is not HTTP/1.1.
            ValueError: a header holds a line break or NUL.
        """
        found = self._origins.get(url)
        if found is None:
            found = self._split(url)
        origin, start = found
        connection = None if fresh else self._take_idle(origin)
        if connection is None:
            connection = await self._connect(origin, pooled=not fresh)
        if progress is not None:
            progress.sent = True
        return await connection.send(self._head(start, headers, len(body), close=fresh), body)

    def _split(self, url: str) -> tuple[_Origin, str]:
        start = url.find("/", url.find("//") + 2)
        base, path = (url, "/") if start < 0 else (url[:start], url[start:])
        if _BAD_HEADER.search(path) or " " in path:
            raise ValueError("the request's path holds a space, a line break or NUL; the request is not sent")
        origin = _origin(base)
        # What every request to this URL starts with: the request line, `Host` and the name of `Content-Length`.
        found = (origin, f"POST {path} HTTP/1.1\r\nHost: {origin.host_header}\r\nContent-Length: ")
        if len(self._origins) < 4096:
            self._origins[url] = found
        return found

    @staticmethod
    def _head(start: str, headers: Sequence[tuple[str, str]], length: int, *, close: bool) -> bytes:
        parts = [start, str(length), "\r\n"]
        accept = False
        for name, value in headers:
            parts += (name, ": ", value, "\r\n")
            if not accept and len(name) == 6 and name.lower() == "accept":
                accept = True
        lines = len(headers) + 4  # the request line, Host, Content-Length, the blank line
        if not accept:
            parts.append("Accept: */*\r\n")
            lines += 1
        if close:
            parts.append("Connection: close\r\n")
            lines += 1
        parts.append("\r\n")
        text = "".join(parts)
        # Every line break is the head's own, one per line: no name or value can end its line early.
        if text.count("\n") != lines or text.count("\r") != lines or "\x00" in text:
            raise ValueError("a request header holds a line break or NUL; the request is not sent")
        return text.encode("latin-1")

    # -- the pool ------------------------------------------------------------------------------------------------------

    def _take_idle(self, origin: _Origin) -> NodeConnection | None:
        stack = self._idle.get(origin)
        if not stack:
            return None
        expiry_s = self.settings.keepalive_expiry_s
        while stack:
            connection = stack.pop()
            self._idle_count -= 1
            if connection.closed or connection.loop.time() - connection.idle_since >= expiry_s:
                connection._close()
                continue
            return connection
        return None

    def put_back(self, connection: NodeConnection) -> None:
        """A pooled connection finished an answer and may serve the next request."""
        if connection.closed:
            return
        if self._idle_count >= self.settings.max_keepalive_connections:
            connection._close()
            return
        loop = connection.loop
        connection.idle_since = loop.time()
        self._idle.setdefault(connection.origin, []).append(connection)
        self._idle_count += 1
        if self._sweeper is None:
            self._sweeper = loop.call_later(self.settings.keepalive_expiry_s, self._sweep)
        if self._waiters:
            self._wake_one()

    def forget(self, connection: NodeConnection) -> None:
        """A connection closed (either side): out of the pool and the count."""
        if connection in self._all:
            self._all.discard(connection)
            stack = self._idle.get(connection.origin)
            if stack and connection in stack:
                stack.remove(connection)
                self._idle_count -= 1
            if connection.pooled:
                self._open -= 1
                self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _sweep(self) -> None:
        """Close the connections idle for `keepalive_expiry_s`; again later while some are idle."""
        self._sweeper = None
        loop = asyncio.get_running_loop()
        oldest = loop.time() - self.settings.keepalive_expiry_s
        for stack in list(self._idle.values()):
            for connection in [c for c in stack if c.idle_since <= oldest]:
                connection._close()
        if self._idle_count:
            self._sweeper = loop.call_later(self.settings.keepalive_expiry_s, self._sweep)

    def _close_oldest_idle(self) -> bool:
        oldest: NodeConnection | None = None
        for stack in self._idle.values():
            if stack and (oldest is None or stack[0].idle_since < oldest.idle_since):
                oldest = stack[0]
        if oldest is None:
            return False
        oldest._close()
        return True

    # -- connecting ------------------------------------------------------------------------------------------------

    async def _connect(self, origin: _Origin, *, pooled: bool) -> NodeConnection:
        settings = self.settings
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.pool_timeout_s + settings.connect_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                if pooled:
                    while self._open >= settings.max_connections:
                        if self._close_oldest_idle():
                            continue
                        waiter = loop.create_future()
                        self._waiters.append(waiter)
                        try:
                            await waiter
                        finally:
                            if not waiter.done():
                                waiter.cancel()
                        found = self._take_idle(origin)
                        if found is not None:
                            return found
                    self._open += 1
                try:
                    return await self._open_connection(origin, pooled=pooled, deadline=deadline)
                except BaseException:
                    if pooled:
                        self._open -= 1
                        self._wake_one()
                    raise
        except TimeoutError as exc:
            if isinstance(exc, NodeConnectTimeout):
                raise
            raise NodeConnectTimeout(
                f"no connection to {origin.host_header} within "
                f"{settings.pool_timeout_s + settings.connect_timeout_s:g} s (upstream.pool_timeout_s and "
                "upstream.connect_timeout_s)"
            ) from None

    async def _open_connection(self, origin: _Origin, *, pooled: bool, deadline: float) -> NodeConnection:
        loop = asyncio.get_running_loop()
        addresses = [origin.host] if origin.literal else await self._resolve(origin)
        tls: ssl.SSLContext | None = None
        if origin.tls:
            if self._tls is None:
                self._tls = await asyncio.to_thread(_tls_context)
            tls = self._tls
        errors: list[str] = []
        last: BaseException | None = None
        for address in addresses:
            limit_s = min(self.settings.connect_timeout_s, deadline - loop.time())
            try:
                async with asyncio.timeout(limit_s):
                    _, protocol = await loop.create_connection(
                        lambda: NodeConnection(self, origin, pooled=pooled),
                        address,
                        origin.port,
                        ssl=tls,
                        server_hostname=origin.host if tls is not None else None,
                    )
            except TimeoutError:
                if len(addresses) == 1:
                    raise NodeConnectTimeout(
                        f"connecting to {origin.host_header} timed out after {limit_s:g} s (upstream.connect_timeout_s)"
                    ) from None
                errors.append(f"{address}: timed out")
                continue
            except (OSError, ssl.SSLError) as exc:
                errors.append(f"{address}: {exc}")
                last = exc
                continue
            connection: NodeConnection = protocol
            self._all.add(connection)
            return connection
        raise NodeConnectError(f"cannot connect to {origin.host_header}: {'; '.join(errors)}") from last

    async def _resolve(self, origin: _Origin) -> list[str]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(origin.host, origin.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise NodeConnectError(f"cannot resolve {origin.host}: {exc}") from exc
        found = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if self.policy is None:
            return found
        allowed = [address for address in found if self.policy.allows_resolved(address)]
        if not allowed:
            raise NodeConnectError(
                f"{origin.host} resolves only to addresses the endpoint allowlist refuses ({', '.join(sorted(found))})"
            )
        return allowed

    async def aclose(self) -> None:
        """Close every connection, idle or answering (an answer in progress then ends with `NodeAnswerCut`)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        connections = list(self._all)
        for connection in connections:
            connection._close()
        if connections:
            await asyncio.wait([c.lost for c in connections], timeout=1.0)


def _tls_context() -> ssl.SSLContext:
    """The TLS context for `https` nodes: the system's CA store and host name checks (blocking: loads files)."""
    context = ssl.create_default_context()
    context.set_alpn_protocols(["http/1.1"])
    return context
