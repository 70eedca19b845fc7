"""Forwarding with failover: send a request to the best node, and to the next one if it fails before a
byte has reached the client.

`Forwarder.open()` is the whole pre-commit phase of one client request. For each attempt it reserves the
least-loaded eligible node (never one already tried; `RoutingTable.reserve`), sends the request
(`UpstreamClient`), and waits for what the client will see first (`UpstreamResponse.receive`): a whole
non-streaming body when it fits the buffer, or the first data event (the first token) of a stream.

Time limits per attempt: a stream's first token within `upstream.ttfb_timeout_s`; a non-streaming answer
(whose headers a node sends only once generation has ended) within `upstream.generation_timeout_s`; both
also within the node's own `deadline_s` and the one request-wide `upstream.request_deadline_s`, which bounds
every attempt and the answer together.

Connect errors, 5xx answers and broken connections are retried on another node while attempts remain. A
timeout is retried only when the node never had the whole request (the connection, or the pool, timed
out): once a node has the request it is working on it, and sending it elsewhere would repeat the prompt's
work on every node in turn (`routing.retry_after_timeout` opts in). What counts against a node's circuit
breaker before the answer is committed (after, the response counts for itself):

- a connect error or broken connection: at once, whatever the request;
- a timeout: the first of the request, and any later one from a node failing its health probes. A request
  too big for the limits times out wherever it goes; it must not open the breakers of healthy nodes;
- a 5xx answer: only once another node has answered the same request. When every node tried answers
  5xx, the request itself is the likely cause (a malformed part llama-server chokes on), and counting it
  would let any client take a model's nodes out of rotation with a few bad requests. 501 and 505 say a
  node does not offer what was asked and never count.

A stale pooled connection that the node closed before answering is retried once on the same node without
counting. A 4xx answer (429 included) is the client's: it is returned as it came and touches no breaker.
When every attempt fails, `FailoverExhausted` carries the attempt count and the last error; a timeout that
ends the request early is raised itself, with `attempts` set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence

from qiip_core._errors import (
    FailoverExhausted,
    RoutingError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamTransportError,
)
from qiip_core.config import UpstreamSettings
from qiip_core.nodes import EndpointPolicy, NodeStatus
from qiip_core.routing._reservation import Reservation
from qiip_core.routing._table import ChangeKind, RoutingTable, TableChange
from qiip_core.upstream._client import (
    TRANSPORT_ERRORS,
    UpstreamClient,
    UpstreamRequest,
    is_stale_connection,
    map_transport_error,
)
from qiip_core.upstream._http11 import NodeResponse, SendProgress
from qiip_core.upstream._response import UpstreamResponse

__all__ = ["Forwarder"]

logger = logging.getLogger("qiip.forward")

_NEUTRAL_STATUSES = frozenset({501, 505})
"""5xx answers that say the node does not offer what was asked, not that it is failing: retried elsewhere,
never counted against the node."""


class _FirstByteLimit:
    """`asyncio.timeout` for one attempt, with less work per request: one timer, cancelled on the way out.

    When it fires it cancels the task; leaving the block, that cancellation (only) becomes `TimeoutError`, as
    `asyncio.timeout` does. `reschedule` moves the limit (`Forwarder._node_down` ends the wait now).
    """

    __slots__ = ("_cancelling", "_expired", "_handle", "_loop", "_task")

    def __init__(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        task = asyncio.current_task(loop)
        assert task is not None
        self._loop = loop
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        self._handle: asyncio.TimerHandle | None = loop.call_at(when, self._fire)

    def reschedule(self, when: float) -> None:
        """End the wait at `when` (the loop's clock) instead."""
        if self._handle is None or self._expired:
            return
        self._handle.cancel()
        self._handle = self._loop.call_at(when, self._fire)

    def expired(self) -> bool:
        """Whether the limit passed and cancelled the wait."""
        return self._expired

    def _fire(self) -> None:
        self._handle = None
        self._expired = True
        self._task.cancel()

    def __enter__(self) -> _FirstByteLimit:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._expired and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc


def _status_of(error: UpstreamError) -> int | None:
    """The node's own HTTP status in a failure, when it answered with one."""
    return error.status if isinstance(error, UpstreamStatusError) else None


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
        retry_after_timeout: bool = False,
        client: UpstreamClient | None = None,
        headers_for: Callable[[str], Mapping[str, str]] | None = None,
        policy: EndpointPolicy | None = None,
    ) -> None:
        self.table = table
        self.settings = settings
        self.max_attempts = max_attempts
        self.retry_after_timeout = retry_after_timeout
        self._headers_for = headers_for
        self._owns_client = client is None
        self.client = client or UpstreamClient(settings, policy=policy)
        # Per node: the first-token timers of requests waiting on it, and its committed answers, so a node
        # its health probes find down lets go of them at once (`_node_down`).
        self._waiting: dict[str, set[_FirstByteLimit]] = {}
        self._answering: dict[str, set[UpstreamResponse]] = {}
        self._unsubscribe = table.add_listener(self._on_change)

    async def aclose(self) -> None:
        """Stop following the table and close the upstream client (when the forwarder created it)."""
        self._unsubscribe()
        if self._owns_client:
            await self.client.aclose()

    def _on_change(self, change: TableChange) -> None:
        if change.node.status is NodeStatus.UNHEALTHY and change.kind is ChangeKind.UPDATED:
            self._node_down(change.node.id)

    def _node_down(self, node_id: str) -> None:
        """The node failed its health probes (it hangs, or is gone): requests still waiting for its first
        token fail over now instead of waiting out their limit, and its answers in progress end (streams with
        an error event)."""
        waiting = self._waiting.get(node_id)
        answering = self._answering.get(node_id)
        if not waiting and not answering:
            return
        logger.warning(
            "node %s failed its health probes: %d waiting request(s) fail over, %d answer(s) end",
            node_id,
            len(waiting or ()),
            len(answering or ()),
        )
        now = asyncio.get_running_loop().time()
        for timer in list(waiting or ()):
            with contextlib.suppress(RuntimeError):
                timer.reschedule(now)
        for response in list(answering or ()):
            response.abort("the node failed its health probes while answering; the answer is incomplete.")

    async def open(self, request: UpstreamRequest) -> UpstreamResponse:
        """Send `request` to the best node, failing over while nothing has reached the client.

        Returns:
            The committed response; the caller must `aclose()` it.

        Raises:
            RoutingError: no node could be reserved for the first attempt (`NoNodes`, `ModelNotFound`,
                `ModelUnavailable`).
            FailoverExhausted: every attempt failed (with `max_attempts` > 1).
            UpstreamTimeout: a node that had the request timed out (not retried without
                `retry_after_timeout`), or the request's deadline passed; `attempts` says how many nodes
                were tried.
            UpstreamError: the one attempt failed (with `max_attempts` == 1).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.request_deadline_s
        tried: list[str] = []
        failures: list[UpstreamError] = []
        timeout_counted = False
        while len(tried) < self.max_attempts:
            try:
                reservation = self.table.reserve(request.model, api=request.api, exclude=tried, prefix=request.prefix)
            except RoutingError:
                if not failures:
                    raise
                break
            node_id = reservation.state.id
            tried.append(node_id)
            try:
                response = await self._attempt(reservation, request, deadline, loop)
            except UpstreamError as exc:
                failures.append(exc)
                logger.warning("attempt %d on node %s failed: %s", len(tried), node_id, exc.log_text)
                # Every failed attempt is in the node's record, for operators, whether or not it counts against
                # its breaker below (a 5xx counts only once another node answers).
                if not exc.local:
                    reservation.note_error(exc.log_text, status=_status_of(exc))
                # Counted before the release, so a failed breaker trial reopens the breaker for longer.
                if isinstance(exc, UpstreamTimeout):
                    if not timeout_counted or reservation.state.health_failures > 0:
                        reservation.record_failure(exc.log_text, noted=True)
                    timeout_counted = True
                elif not isinstance(exc, UpstreamStatusError) and not exc.local:
                    # The node could not be reached or broke off: its fault, whatever the request (unless the
                    # gateway itself ran out of file descriptors).
                    reservation.record_failure(exc.log_text, noted=True)
                reservation.release()
                if isinstance(exc, UpstreamTimeout):
                    if exc.request_sent and not self.retry_after_timeout:
                        exc.message += (
                            " The node had the whole request, so it was not sent to another node"
                            " (routing.retry_after_timeout)."
                        )
                        exc.attempts = len(tried)
                        raise exc from None
                    if loop.time() >= deadline:
                        exc.attempts = len(tried)
                        raise exc from None
                continue
            except BaseException:
                reservation.release()
                raise
            # Another node answered the same request: the 5xx answers before it were the nodes' fault.
            self._blame_status_failures(failures)
            response.attempts = len(tried)
            response.failures = failures
            response.timeout_counted = timeout_counted
            if not response.complete:
                answering = self._answering.setdefault(node_id, set())
                answering.add(response)
                response._registry = answering
            return response
        # Every node tried answered 5xx (or failed): when all that came back were answers, the request itself
        # is the likely cause, and no breaker moves.
        last = failures[-1]
        if self.max_attempts == 1:
            raise last
        exhausted = FailoverExhausted(attempts=len(failures), last=last, failures=failures)
        exhausted.retry_after_s = self.table.retry_after_s(request.model)
        raise exhausted

    def _blame_status_failures(self, failures: list[UpstreamError]) -> None:
        for failure in failures:
            if (
                isinstance(failure, UpstreamStatusError)
                and failure.node_id is not None
                and failure.status not in _NEUTRAL_STATUSES
            ):
                self.table.record_failure(failure.node_id, failure.log_text, noted=True)

    async def _attempt(
        self, reservation: Reservation, request: UpstreamRequest, deadline: float, loop: asyncio.AbstractEventLoop
    ) -> UpstreamResponse:
        """One attempt on one node: send, and wait for the answer's first token (or all of a plain one).

        Args:
            reservation: the node, reserved.
            request: the client's request.
            deadline: the request-wide deadline, in the event loop's clock.
            loop: the running event loop.

        Raises:
            UpstreamTimeout: a limit passed (`request_sent` when the node had the whole request).
            UpstreamError: any other failure of the node.
        """
        node = reservation.state.node
        node_id = node.id
        url = node.endpoint + request.path
        started = loop.time()
        # The tightest of: this attempt's own limit, the node's deadline, the request's deadline.
        limits = [
            (self.settings.ttfb_timeout_s if request.stream else self.settings.generation_timeout_s, ""),
            (deadline - started, " (the request's deadline)"),
        ]
        node_deadline_s = node.capabilities.deadline_s
        if node_deadline_s is not None:
            limits.append((node_deadline_s, " (the node's deadline)"))
        limit_s, which = min(limits)
        if limit_s <= 0:
            raise UpstreamTimeout("the request's deadline passed before this node could be tried.", node_id=node_id)
        answer_deadline = min(deadline, started + node_deadline_s) if node_deadline_s is not None else deadline
        headers = request.headers
        if self._headers_for is not None and (extra := self._headers_for(node_id)):
            headers = [*headers, *extra.items()]
        progress = SendProgress()
        waiting = self._waiting.setdefault(node_id, set())
        first_byte = _FirstByteLimit(loop, started + limit_s)
        try:
            with first_byte:
                waiting.add(first_byte)
                response = await self._send(url, request.body, headers, node_id, progress)
                try:
                    return await UpstreamResponse.receive(
                        reservation, response, self.settings, deadline=answer_deadline, loop=loop
                    )
                except BaseException:
                    response.close()
                    raise
        except TRANSPORT_ERRORS as exc:
            if (
                isinstance(exc, TimeoutError)
                and first_byte.expired()
                and reservation.state.liveness is NodeStatus.UNHEALTHY
            ):
                # Ended by `_node_down`: the node's work is lost anyway, so another node may be tried.
                raise UpstreamTransportError(
                    "the node failed its health probes while this request waited for it.", node_id=node_id
                ) from None
            if isinstance(exc, TimeoutError) and first_byte.expired():
                what = "first token" if request.stream else "answer"
                raise UpstreamTimeout(
                    f"the node sent no {what} within {limit_s:g} s{which}.",
                    node_id=node_id,
                    request_sent=progress.sent,
                ) from None
            raise map_transport_error(exc, node_id) from exc
        finally:
            waiting.discard(first_byte)
            if not waiting:
                self._waiting.pop(node_id, None)

    async def _send(
        self, url: str, body: bytes, headers: Sequence[tuple[str, str]], node_id: str, progress: SendProgress
    ) -> NodeResponse:
        try:
            return await self.client.post(url, body, headers, progress)
        except TRANSPORT_ERRORS as exc:
            # A pooled keep-alive connection the node closed (or was closing) when we used it fails before any
            # response byte, in one of several ways (`is_stale_connection`): one more try on the same node, on a
            # new connection (another pooled one may be dead too), is not a node failure. A failed connect is,
            # and goes to failover at once; so does a timeout, by its own rules.
            if not is_stale_connection(exc):
                raise
            logger.debug("node %s: retrying on a new connection after %r", node_id, exc)
            progress.sent = False
            return await self.client.post(url, body, headers, progress, fresh=True)
