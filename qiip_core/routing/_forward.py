"""Forwarding with failover: send a request to the best node, and to the next one if it fails before a
byte has reached the client.

`Forwarder.open()` is the whole pre-commit phase of one client request. For each attempt it reserves the
least-loaded eligible node (never one already tried; `RoutingTable.reserve`), sends the request
(`UpstreamClient`), and waits for what the client will see first (`UpstreamResponse.receive`): a whole
non-streaming body when it fits the buffer, or the first complete event of a stream.

Connect errors, timeouts and 5xx answers are retried on another node while attempts remain. What counts
against a node's circuit breaker before the answer is committed (after, the response counts for itself):

- a connect error or timeout: at once, whatever the request;
- a 5xx answer: only once another node has answered the same request. When every node tried answers
  5xx, the request itself is the likely cause (a malformed part llama-server chokes on), and counting it
  would let any client take a model's nodes out of rotation with a few bad requests. 501 and 505 say a
  node does not offer what was asked and never count.

A stale pooled connection that the node closed before answering is retried once on the same node without
counting. A 4xx answer (429 included) is the client's: it is returned as it came and touches no breaker.
When every attempt fails, `FailoverExhausted` carries the attempt count and the last error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

import aiohttp

from qiip_core._errors import FailoverExhausted, RoutingError, UpstreamError, UpstreamStatusError, UpstreamTimeout
from qiip_core.config import UpstreamSettings
from qiip_core.routing._response import UpstreamResponse
from qiip_core.routing._table import Reservation, RoutingTable
from qiip_core.routing._upstream import TRANSPORT_ERRORS, UpstreamClient, UpstreamRequest, map_transport_error

__all__ = ["Forwarder"]

logger = logging.getLogger("qiip.forward")

_NEUTRAL_STATUSES = frozenset({501, 505})
"""5xx answers that say the node does not offer what was asked, not that it is failing: retried elsewhere,
never counted against the node."""


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
        deadline = started + node_deadline_s if node_deadline_s is not None else None
        try:
            async with asyncio.timeout(ttfb_s) as first_byte:
                response = await self._send(url, request.body, headers, node_id)
                try:
                    return await UpstreamResponse.receive(reservation, response, self.settings, deadline=deadline)
                except BaseException:
                    response.close()
                    raise
        except TRANSPORT_ERRORS as exc:
            if isinstance(exc, TimeoutError) and first_byte.expired():
                raise UpstreamTimeout(f"the node sent no first byte within {ttfb_s:g} s.", node_id=node_id) from None
            raise map_transport_error(exc, node_id) from exc

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
