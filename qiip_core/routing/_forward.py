"""Forwarding with failover: send a request to the best node, and to the next one if it fails before a
byte has reached the client.

`Forwarder.open()` is the whole pre-commit phase of one client request. For each attempt it reserves the
least-loaded eligible node (never one already tried), sends the request, and waits for what the client
will see first:

- a non-streaming answer: the status, headers and the body (read whole when it fits
  `buffer_response_bytes`, so a node dying while sending it can still be failed over);
- a streaming answer (`text/event-stream`): the status, headers and the first complete event, so a node
  that accepts the request and then fails before its first token is failed over too.

Connect errors, timeouts and 5xx answers are retried on another node while attempts remain; they count
against the node's circuit breaker. A stale pooled connection that the node closed before answering is
retried once on the same node without counting. A 4xx answer (429 included) is the client's: it is
returned as it came and touches no breaker. When every attempt fails, `FailoverExhausted` carries the
attempt count and the last error.

What `open()` returns, an `UpstreamResponse`, holds the node's reservation until `aclose()`; its
`read()` gives the rest of the body, whole SSE events at a time for streams, under the inter-chunk idle
timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import httpx

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
from qiip_core.routing._sse import EventFramer
from qiip_core.routing._table import Reservation, RoutingTable

__all__ = [
    "HOP_BY_HOP_HEADERS",
    "Forwarder",
    "UpstreamRequest",
    "UpstreamResponse",
    "create_upstream_client",
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

# Most specific first: the first matching class decides. A test asserts every httpx transport error class
# is covered by some row.
_TRANSPORT_ERRORS: tuple[tuple[type[httpx.HTTPError], type[UpstreamError], str], ...] = (
    (httpx.ConnectTimeout, UpstreamTimeout, "connecting to the node timed out"),
    (httpx.ReadTimeout, UpstreamTimeout, "the node stopped sending"),
    (httpx.WriteTimeout, UpstreamTimeout, "sending the request to the node timed out"),
    (httpx.PoolTimeout, UpstreamTimeout, "no connection to the node was free in time"),
    (httpx.TimeoutException, UpstreamTimeout, "the node timed out"),
    (httpx.ConnectError, UpstreamConnectError, "the node refused or dropped the connection"),
    (httpx.RemoteProtocolError, UpstreamTransportError, "the node broke the HTTP protocol"),
    (httpx.LocalProtocolError, UpstreamTransportError, "the request could not be sent to the node"),
    (httpx.ReadError, UpstreamTransportError, "reading from the node failed"),
    (httpx.WriteError, UpstreamTransportError, "writing to the node failed"),
    (httpx.CloseError, UpstreamTransportError, "closing the connection to the node failed"),
    (httpx.ProxyError, UpstreamTransportError, "a proxy between the gateway and the node failed"),
    (httpx.UnsupportedProtocol, UpstreamTransportError, "the node's URL scheme is not supported"),
    (httpx.DecodingError, UpstreamTransportError, "the node's response could not be decoded"),
    (httpx.TransportError, UpstreamTransportError, "the connection to the node failed"),
)


def map_transport_error(exc: httpx.TransportError | httpx.DecodingError, node_id: str | None) -> UpstreamError:
    """Translate an httpx error into QIIP's tree (most specific class wins).

    Args:
        exc: the httpx error.
        node_id: the node the request went to.

    Returns:
        `UpstreamTimeout` (504), `UpstreamConnectError` (502) or `UpstreamTransportError` (502).
    """
    for httpx_type, ours, text in _TRANSPORT_ERRORS:
        if isinstance(exc, httpx_type):
            detail = str(exc) or type(exc).__name__
            return ours(f"{text} ({detail}).", node_id=node_id)
    return UpstreamTransportError(f"the connection to the node failed ({exc!r}).", node_id=node_id)


def create_upstream_client(settings: UpstreamSettings) -> httpx.AsyncClient:
    """The HTTP client for node traffic: a sized pool, keep-alive expiry below the nodes' own idle timeout.

    Proxy environment variables are ignored (node traffic never goes through a proxy) and redirects are
    never followed. Read timeouts are enforced by the forwarder itself (time to first byte, then
    inter-chunk idle), so the client's own read timeout is only a backstop.
    """
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            connect=settings.connect_timeout_s,
            read=settings.ttfb_timeout_s + settings.idle_timeout_s,
            write=settings.write_timeout_s,
            pool=settings.pool_timeout_s,
        ),
        limits=httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_keepalive_connections,
            keepalive_expiry=settings.keepalive_expiry_s,
        ),
        trust_env=False,
        follow_redirects=False,
    )


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    """One client request, ready to send to any node serving its model.

    Attributes:
        path: the API path, for example `/v1/chat/completions`.
        body: the client's body, forwarded byte for byte.
        headers: headers to forward (already filtered of hop-by-hop and client credentials).
        model: the requested model.
        stream: True when the client asked for SSE (`"stream": true`).
    """

    path: str
    body: bytes
    headers: Sequence[tuple[str, str]]
    model: str
    stream: bool


@dataclass(slots=True)
class UpstreamResponse:
    """A node's response that the gateway has committed to relaying.

    Attributes:
        reservation: the node's reservation, released by `aclose()`.
        status_code: the node's status.
        headers: response headers to relay (hop-by-hop removed; for SSE also content-encoding).
        prefix: the bytes already read: the first event(s) of a stream or the start (or all) of a body.
        complete: True when `prefix` is the whole body.
        sse: True for an event stream.
        attempts: nodes tried, this one included.
        failures: the errors of the earlier attempts, oldest first.
    """

    reservation: Reservation
    status_code: int
    headers: list[tuple[bytes, bytes]]
    prefix: bytes
    complete: bool
    sse: bool
    attempts: int
    failures: list[UpstreamError] = field(default_factory=list)
    _response: httpx.Response | None = None
    _chunks: AsyncIterator[bytes] | None = None
    _framer: EventFramer | None = None
    _idle_timeout_s: float = 60.0

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
        if self.complete or self._response is None:
            return b""
        chunks = self._chunks
        assert chunks is not None
        while True:
            try:
                async with asyncio.timeout(self._idle_timeout_s):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                self.complete = True
                return self._framer.flush() if self._framer is not None else b""
            except TimeoutError:
                raise UpstreamTimeout(
                    f"the node sent nothing for {self._idle_timeout_s:g} s.", node_id=self.node_id
                ) from None
            except (httpx.TransportError, httpx.DecodingError) as exc:
                raise map_transport_error(exc, self.node_id) from exc
            if self._framer is None:
                if chunk:
                    return chunk
                continue
            out = self._framer.feed(chunk)
            if out:
                return out

    async def aclose(self) -> None:
        """Close the node's response (the node sees the disconnect if it was still sending) and release the
        reservation. Idempotent."""
        try:
            if self._response is not None:
                response, self._response = self._response, None
                await response.aclose()
        finally:
            self.reservation.release()


class Forwarder:
    """Sends client requests to nodes with least-connections selection and failover.

    Args:
        table: the routing table to reserve nodes from and report failures to.
        settings: timeouts and buffer sizes.
        max_attempts: nodes tried per request, the first included.
        client: the HTTP client; by default one from `create_upstream_client(settings)`, closed by `aclose()`.
    """

    def __init__(
        self,
        table: RoutingTable,
        settings: UpstreamSettings,
        *,
        max_attempts: int = 3,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.table = table
        self.settings = settings
        self.max_attempts = max_attempts
        self._owns_client = client is None
        self.client = client or create_upstream_client(settings)

    async def aclose(self) -> None:
        """Close the HTTP client (when the forwarder created it)."""
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
                reservation = self.table.reserve(request.model, exclude=tried)
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
                self.table.record_failure(node_id, exc.message)
                failures.append(exc)
                logger.warning("attempt %d on node %s failed: %s", len(tried), node_id, exc.message)
                continue
            except BaseException:
                reservation.release()
                raise
            response.attempts = len(tried)
            response.failures = failures
            return response
        last = failures[-1]
        if self.max_attempts == 1:
            raise last
        raise FailoverExhausted(attempts=len(failures), last=last, failures=failures)

    async def _attempt(self, reservation: Reservation, request: UpstreamRequest) -> UpstreamResponse:
        node_id = reservation.state.id
        url = reservation.state.node.endpoint + request.path
        try:
            async with asyncio.timeout(self.settings.ttfb_timeout_s):
                response = await self._send(url, request, node_id)
                try:
                    return await self._first_bytes(reservation, request, response)
                except BaseException:
                    await response.aclose()
                    raise
        except TimeoutError:
            raise UpstreamTimeout(
                f"the node sent no first byte within {self.settings.ttfb_timeout_s:g} s.", node_id=node_id
            ) from None
        except (httpx.TransportError, httpx.DecodingError) as exc:
            raise map_transport_error(exc, node_id) from exc

    async def _send(self, url: str, request: UpstreamRequest, node_id: str) -> httpx.Response:
        for retry in (True, False):
            outgoing = self.client.build_request("POST", url, content=request.body, headers=request.headers)
            try:
                return await self.client.send(outgoing, stream=True)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                # A pooled keep-alive connection the node closed just before we used it fails like this
                # with no response byte; one fresh try on the same node is not a node failure.
                if not retry:
                    raise
                logger.debug("node %s: retrying on a fresh connection after %r", node_id, exc)
        raise AssertionError("unreachable")

    async def _first_bytes(
        self, reservation: Reservation, request: UpstreamRequest, response: httpx.Response
    ) -> UpstreamResponse:
        node_id = reservation.state.id
        status = response.status_code
        if status >= 500:
            body = await _read_at_most(response, _ERROR_BODY_BYTES)
            text = body[:200].decode("utf-8", "replace")
            raise UpstreamStatusError(
                f"HTTP {status}: {text}" if text else f"HTTP {status}",
                node_id=node_id,
                status=status,
                body=body,
            )
        content_type = response.headers.get("content-type", "")
        sse = status == 200 and content_type.startswith("text/event-stream")
        headers = _relay_headers(response, decoded=sse)
        result = UpstreamResponse(
            reservation=reservation,
            status_code=status,
            headers=headers,
            prefix=b"",
            complete=False,
            sse=sse,
            attempts=1,
            _response=response,
            _idle_timeout_s=self.settings.idle_timeout_s,
        )
        if sse:
            framer = EventFramer(self.settings.max_event_bytes)
            chunks = response.aiter_bytes()
            result._framer = framer
            result._chunks = chunks
            result.prefix = await _first_event(chunks, framer, response)
        else:
            chunks = response.aiter_raw()
            result._chunks = chunks
            result.prefix, result.complete = await _buffer(chunks, self.settings.buffer_response_bytes)
        if result.complete:
            await response.aclose()
            result._response = None
        return result


def _relay_headers(response: httpx.Response, *, decoded: bool) -> list[tuple[bytes, bytes]]:
    headers = []
    for name, value in response.headers.raw:
        lower = name.lower()
        if lower in HOP_BY_HOP_HEADERS or (decoded and lower == b"content-encoding"):
            continue
        headers.append((lower, value))
    return headers


async def _read_at_most(response: httpx.Response, limit: int) -> bytes:
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) >= limit:
            break
    return bytes(body[:limit])


async def _first_event(chunks: AsyncIterator[bytes], framer: EventFramer, response: httpx.Response) -> bytes:
    """Read until the stream holds one complete event (or ends)."""
    while True:
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            tail = framer.flush()
            if not tail:
                raise httpx.RemoteProtocolError(
                    "the event stream ended before its first event", request=response.request
                ) from None
            return tail
        out = framer.feed(chunk)
        if out:
            return out


async def _buffer(chunks: AsyncIterator[bytes], limit: int) -> tuple[bytes, bool]:
    """Read up to `limit` bytes; returns (bytes, whole body read)."""
    body = bytearray()
    while True:
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            return bytes(body), True
        body += chunk
        if len(body) > limit:
            return bytes(body), False
