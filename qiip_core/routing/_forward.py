"""Forwarding with failover: send a request to the best node, and to the next one if it fails before a
byte has reached the client.

`Forwarder.open()` is the whole pre-commit phase of one client request. For each attempt it reserves the
least-loaded eligible node (never one already tried), sends the request, and waits for what the client
will see first:

- a non-streaming answer: the status, headers and the body (read whole when it fits
  `buffer_response_bytes`, so a node dying while sending it can still be failed over);
- a streaming answer (`text/event-stream`): the status, headers and the first complete event, so a node
  that accepts the request and then fails before its first token is failed over too.

Connect errors, timeouts and 5xx answers are retried on another node while attempts remain. What counts
against a node's circuit breaker:

- a connect error or timeout: at once, whatever the request;
- a 5xx answer: only once another node has answered the same request. When every node tried answers
  5xx, the request itself is the likely cause (a malformed part llama-server chokes on), and counting it
  would let any client take a model's nodes out of rotation with a few bad requests. 501 and 505 say a
  node does not offer what was asked and never count.

A stale pooled connection that the node closed before answering is retried once on the same node without
counting. A 4xx answer (429 included) is the client's: it is returned as it came and touches no breaker.
When every attempt fails, `FailoverExhausted` carries the attempt count and the last error.

What `open()` returns, an `UpstreamResponse`, holds the node's reservation until `aclose()`; its
`read()` gives the rest of the body, whole SSE events at a time for streams, under the inter-chunk idle
timeout.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from qiip_core._errors import (
    FailoverExhausted,
    RoutingError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamTransportError,
)
from qiip_core.config import UpstreamSettings
from qiip_core.nodes import ApiName
from qiip_core.routing._sse import EventFramer
from qiip_core.routing._table import Reservation, RoutingTable

__all__ = [
    "HOP_BY_HOP_HEADERS",
    "Forwarder",
    "UpstreamClient",
    "UpstreamRequest",
    "UpstreamResponse",
    "map_transport_error",
]

logger = logging.getLogger("qiip.forward")

HOP_BY_HOP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"host",
    }
)
"""Headers that describe one connection, never relayed in either direction."""

_ERROR_BODY_BYTES = 4096

_NEUTRAL_STATUSES = frozenset({501, 505})
"""5xx answers that say the node does not offer what was asked, not that it is failing: retried elsewhere,
never counted against the node."""

# Most specific first: the first matching class decides. A test asserts that every aiohttp client error
# class is matched by some row.
_TRANSPORT_ERRORS: tuple[tuple[type[BaseException], type[UpstreamError], str], ...] = (
    (aiohttp.ConnectionTimeoutError, UpstreamTimeout, "connecting to the node timed out"),
    (aiohttp.SocketTimeoutError, UpstreamTimeout, "the node stopped sending"),
    (aiohttp.ServerTimeoutError, UpstreamTimeout, "the node timed out"),
    (aiohttp.ClientConnectorError, UpstreamConnectError, "the node refused or dropped the connection"),
    (aiohttp.ServerFingerprintMismatch, UpstreamConnectError, "the node's TLS certificate did not match its pin"),
    (aiohttp.ServerDisconnectedError, UpstreamTransportError, "the node closed the connection"),
    (aiohttp.ClientPayloadError, UpstreamTransportError, "the node's response was cut short or malformed"),
    (aiohttp.ClientResponseError, UpstreamTransportError, "the node's response could not be parsed"),
    (aiohttp.ClientOSError, UpstreamTransportError, "the connection to the node failed"),
    (aiohttp.ServerConnectionError, UpstreamTransportError, "the connection to the node failed"),
    (aiohttp.ClientConnectionError, UpstreamTransportError, "the connection to the node failed"),
    (aiohttp.InvalidURL, UpstreamTransportError, "the node's URL is invalid"),
    (aiohttp.NonHttpUrlClientError, UpstreamTransportError, "the node's URL is not HTTP"),
    (aiohttp.RedirectClientError, UpstreamTransportError, "the node answered with a redirect that cannot be used"),
    (
        aiohttp.client_exceptions.UploadAbortedError,
        UpstreamTransportError,
        "sending the request to the node was aborted",
    ),
    (aiohttp.ClientError, UpstreamTransportError, "the connection to the node failed"),
    (zlib.error, UpstreamTransportError, "the node's compressed response could not be decoded"),
    (TimeoutError, UpstreamTimeout, "the node timed out"),
    (OSError, UpstreamTransportError, "the connection to the node failed"),
)

TRANSPORT_ERRORS = (aiohttp.ClientError, zlib.error, TimeoutError, OSError)
"""Exceptions `map_transport_error` translates."""


def map_transport_error(exc: BaseException, node_id: str | None) -> UpstreamError:
    """Translate a client library error into QIIP's tree (most specific class wins).

    Args:
        exc: the aiohttp, zlib or OS error.
        node_id: the node the request went to.

    Returns:
        `UpstreamTimeout` (504), `UpstreamConnectError` (502) or `UpstreamTransportError` (502).
    """
    for library_type, ours, text in _TRANSPORT_ERRORS:
        if isinstance(exc, library_type):
            detail = str(exc) or type(exc).__name__
            return ours(f"{text} ({detail}).", node_id=node_id)
    return UpstreamTransportError(f"the connection to the node failed ({exc!r}).", node_id=node_id)


class UpstreamClient:
    """The HTTP/1.1 client for node traffic: one keep-alive pool for all nodes.

    Built on aiohttp, which relays several times more requests per second than httpx on one core (see
    docs/performance.md). Proxy environment variables are ignored (node traffic never goes through a
    proxy), redirects are never followed, and bodies are not decompressed (non-streaming answers are
    relayed as they come, with their `Content-Encoding`).

    Args:
        settings: pool size, keep-alive expiry (keep it below the nodes' idle timeout; vLLM's is 5 s),
            connect and pool timeouts.
    """

    def __init__(self, settings: UpstreamSettings) -> None:
        self.settings = settings
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The aiohttp session, created on first use (it must be created inside the event loop)."""
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self.settings.max_connections,
                limit_per_host=0,
                keepalive_timeout=self.settings.keepalive_expiry_s,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                trust_env=False,
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=self.settings.pool_timeout_s + self.settings.connect_timeout_s,
                    sock_connect=self.settings.connect_timeout_s,
                ),
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
        return self._session

    async def post(self, url: str, body: bytes, headers: Sequence[tuple[str, str]]) -> aiohttp.ClientResponse:
        """Send a POST and return once the response headers have arrived.

        Raises:
            aiohttp.ClientError, TimeoutError, OSError: as aiohttp raises them (see `map_transport_error`).
        """
        return await self.session.post(url, data=body, headers=headers, allow_redirects=False)

    async def aclose(self) -> None:
        """Close every pooled connection."""
        if self._session is not None:
            await self._session.close()


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    """One client request, ready to send to any node serving its model.

    Attributes:
        path: the API path, for example `/v1/chat/completions`.
        body: the client's body, forwarded byte for byte.
        headers: headers to forward (already filtered of hop-by-hop and client credentials).
        model: the requested model.
        stream: True when the client asked for SSE (`"stream": true`).
        api: which OpenAI API this is, to route only to nodes that serve it (None: any node of the model).
    """

    path: str
    body: bytes
    headers: Sequence[tuple[str, str]]
    model: str
    stream: bool
    api: ApiName | None = None


@dataclass(slots=True)
class UpstreamResponse:
    """A node's response that the gateway has committed to relaying.

    Attributes:
        reservation: the node's reservation, released by `aclose()`.
        status_code: the node's status.
        headers: response headers to relay: hop-by-hop, CORS and the gateway's own (server, date, request id)
            removed; for SSE also content-encoding and cache-control.
        prefix: the bytes already read: the first event(s) of a stream or the start (or all) of a body.
        complete: True when `prefix` is the whole body.
        sse: True for an event stream (relayed whole events at a time).
        attempts: nodes tried, this one included.
        failures: the errors of the earlier attempts, oldest first.
    """

    reservation: Reservation
    status_code: int
    headers: list[tuple[bytes, bytes]]
    prefix: bytes
    complete: bool
    sse: bool
    attempts: int = 1
    failures: list[UpstreamError] = field(default_factory=list)
    _response: aiohttp.ClientResponse | None = None
    _framer: EventFramer | None = None
    _decoder: zlib._Decompress | None = None
    _idle_timeout_s: float = 60.0
    _deadline: float | None = None

    @property
    def node_id(self) -> str:
        """The node serving this response."""
        return self.reservation.state.id

    async def read(self) -> bytes:
        """The next piece of the body: whole events for a stream. Returns b"" at the end.

        Raises:
            UpstreamTimeout: the node sent nothing for `idle_timeout_s`.
            UpstreamTransportError: the connection broke (the relay reports it in-band).
        """
        response = self._response
        if self.complete or response is None:
            return b""
        while True:
            wait_s = self._idle_timeout_s
            if self._deadline is not None:
                left = self._deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    raise UpstreamTimeout("the node's request deadline passed.", node_id=self.node_id)
                wait_s = min(wait_s, left)
            try:
                async with asyncio.timeout(wait_s):
                    chunk = await response.content.readany()
                if self._decoder is not None:
                    chunk = self._decoder.decompress(chunk) if chunk else self._decoder.flush()
            except TimeoutError as exc:
                if isinstance(exc, aiohttp.ClientError):
                    raise map_transport_error(exc, self.node_id) from exc
                if self._deadline is not None and asyncio.get_running_loop().time() >= self._deadline:
                    raise UpstreamTimeout("the node's request deadline passed.", node_id=self.node_id) from None
                raise UpstreamTimeout(
                    f"the node sent nothing for {self._idle_timeout_s:g} s.", node_id=self.node_id
                ) from None
            except TRANSPORT_ERRORS as exc:
                raise map_transport_error(exc, self.node_id) from exc
            if not chunk and response.content.at_eof():
                self.complete = True
                return self._framer.flush() if self._framer is not None else b""
            if self._framer is None:
                if chunk:
                    return chunk
                continue
            out = self._framer.feed(chunk)
            if out:
                return out

    async def aclose(self) -> None:
        """Finish with the node's response and release the reservation. Idempotent.

        A response read to its end returns its connection to the pool; one abandoned early (the client
        left, the relay failed) closes the connection, so the node sees the disconnect at once.
        """
        try:
            response, self._response = self._response, None
            if response is not None:
                if self.complete:
                    response.release()
                else:
                    response.close()
        finally:
            self.reservation.release()


class Forwarder:
    """Sends client requests to nodes with least-connections selection and failover.

    Args:
        table: the routing table to reserve nodes from and report failures to.
        settings: timeouts and buffer sizes.
        max_attempts: nodes tried per request, the first included.
        client: the upstream client; by default one from `settings`, closed by `aclose()`.
        headers_for: extra request headers for a node (an attached server's bearer token).
    """

    def __init__(
        self,
        table: RoutingTable,
        settings: UpstreamSettings,
        *,
        max_attempts: int = 3,
        client: UpstreamClient | None = None,
        headers_for: Callable[[str], Mapping[str, str]] | None = None,
    ) -> None:
        self.table = table
        self.settings = settings
        self.max_attempts = max_attempts
        self._headers_for = headers_for
        self._owns_client = client is None
        self.client = client or UpstreamClient(settings)

    async def aclose(self) -> None:
        """Close the upstream client (when the forwarder created it)."""
        if self._owns_client:
            await self.client.aclose()

    async def open(self, request: UpstreamRequest) -> UpstreamResponse:
        """Send `request` to the best node, failing over while nothing has reached the client.

        Returns:
            The committed response; the caller must `aclose()` it.

        Raises:
            RoutingError: no node could be reserved for the first attempt (`NoNodes`, `ModelNotFound`,
                `ModelUnavailable`).
            FailoverExhausted: every attempt failed (with `max_attempts` > 1).
            UpstreamError: the one attempt failed (with `max_attempts` == 1).
        """
        tried: list[str] = []
        failures: list[UpstreamError] = []
        while len(tried) < self.max_attempts:
            try:
                reservation = self.table.reserve(request.model, api=request.api, exclude=tried)
            except RoutingError:
                if not failures:
                    raise
                break
            node_id = reservation.state.id
            tried.append(node_id)
            try:
                response = await self._attempt(reservation, request)
            except UpstreamError as exc:
                reservation.release()
                if not isinstance(exc, UpstreamStatusError):
                    # The node could not be reached or did not answer in time: its fault, whatever the request.
                    self.table.record_failure(node_id, exc.message)
                failures.append(exc)
                logger.warning("attempt %d on node %s failed: %s", len(tried), node_id, exc.message)
                continue
            except BaseException:
                reservation.release()
                raise
            # Another node answered the same request: the 5xx answers before it were the nodes' fault.
            self._blame_status_failures(failures)
            response.attempts = len(tried)
            response.failures = failures
            return response
        # Every node tried answered 5xx (or failed): when all that came back were answers, the request itself
        # is the likely cause, and no breaker moves.
        last = failures[-1]
        if self.max_attempts == 1:
            raise last
        raise FailoverExhausted(attempts=len(failures), last=last, failures=failures)

    def _blame_status_failures(self, failures: list[UpstreamError]) -> None:
        for failure in failures:
            if (
                isinstance(failure, UpstreamStatusError)
                and failure.node_id is not None
                and failure.status not in _NEUTRAL_STATUSES
            ):
                self.table.record_failure(failure.node_id, failure.message)

    async def _attempt(self, reservation: Reservation, request: UpstreamRequest) -> UpstreamResponse:
        node = reservation.state.node
        node_id = node.id
        url = node.endpoint + request.path
        ttfb_s = self.settings.ttfb_timeout_s
        node_deadline_s = node.capabilities.deadline_s
        if node_deadline_s is not None:
            ttfb_s = min(ttfb_s, node_deadline_s)
        headers = request.headers
        if self._headers_for is not None and (extra := self._headers_for(node_id)):
            headers = [*headers, *extra.items()]
        started = asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(ttfb_s) as deadline:
                response = await self._send(url, request.body, headers, node_id)
                try:
                    result = await self._first_bytes(reservation, response)
                except BaseException:
                    response.close()
                    raise
        except TRANSPORT_ERRORS as exc:
            if isinstance(exc, TimeoutError) and deadline.expired():
                raise UpstreamTimeout(f"the node sent no first byte within {ttfb_s:g} s.", node_id=node_id) from None
            raise map_transport_error(exc, node_id) from exc
        if node_deadline_s is not None:
            result._deadline = started + node_deadline_s
        return result

    async def _send(
        self, url: str, body: bytes, headers: Sequence[tuple[str, str]], node_id: str
    ) -> aiohttp.ClientResponse:
        for retry in (True, False):
            try:
                return await self.client.post(url, body, headers)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # A pooled keep-alive connection the node closed (or reset) just before we used it fails like
                # this, before any response byte; one fresh try on the same node is not a node failure. A
                # failed connect is (ClientConnectorError), and goes to failover at once.
                if not retry or isinstance(exc, aiohttp.ClientConnectorError):
                    raise
                logger.debug("node %s: retrying on a fresh connection after %r", node_id, exc)
        raise AssertionError("unreachable")

    async def _first_bytes(self, reservation: Reservation, response: aiohttp.ClientResponse) -> UpstreamResponse:
        node_id = reservation.state.id
        status = response.status
        if status >= 500:
            body = await _read_at_most(response, _ERROR_BODY_BYTES)
            text = body[:200].decode("utf-8", "replace")
            raise UpstreamStatusError(
                f"HTTP {status}: {text}" if text else f"HTTP {status}", node_id=node_id, status=status, body=body
            )
        encoding = response.headers.get("content-encoding", "identity").lower()
        sse = status == 200 and response.content_type == "text/event-stream" and encoding in _DECODABLE
        result = UpstreamResponse(
            reservation=reservation,
            status_code=status,
            headers=_relay_headers(response, decoded=sse),
            prefix=b"",
            complete=False,
            sse=sse,
            _response=response,
            _idle_timeout_s=self.settings.idle_timeout_s,
        )
        if sse:
            result._framer = EventFramer(self.settings.max_event_bytes)
            if encoding != "identity":
                result._decoder = zlib.decompressobj(_DECODABLE[encoding])
            result.prefix = await result.read()
            if not result.prefix:
                raise UpstreamTransportError("the event stream ended before its first event.", node_id=node_id)
        else:
            result.prefix, result.complete = await _buffer(response, self.settings.buffer_response_bytes)
        if result.complete:
            response.release()
            result._response = None
        return result


_DECODABLE = {"identity": 0, "gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


_GATEWAY_HEADERS = frozenset({b"server", b"date", b"x-request-id", b"x-accel-buffering"})
"""Response headers the gateway sets itself; the node's are dropped so the client never sees two."""

_STREAM_HEADERS = frozenset({b"content-encoding", b"cache-control"})
"""Dropped from decoded event streams: the gateway relays them decoded and sets its own cache policy."""


def _relay_headers(response: aiohttp.ClientResponse, *, decoded: bool) -> list[tuple[bytes, bytes]]:
    headers = []
    for name, value in response.raw_headers:
        lower = name.lower()
        if (
            lower in HOP_BY_HOP_HEADERS
            or lower in _GATEWAY_HEADERS
            # A node's CORS answer is not the gateway's policy.
            or lower.startswith(b"access-control-")
            or (decoded and lower in _STREAM_HEADERS)
        ):
            continue
        headers.append((lower, value))
    return headers


async def _read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes:
    body = bytearray()
    while len(body) < limit:
        chunk = await response.content.readany()
        if not chunk:
            break
        body += chunk
    return bytes(body[:limit])


async def _buffer(response: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """Read up to `limit` bytes; returns (bytes, whole body read)."""
    body = bytearray()
    while True:
        chunk = await response.content.readany()
        if not chunk:
            return bytes(body), True
        body += chunk
        if len(body) > limit:
            return bytes(body), False
