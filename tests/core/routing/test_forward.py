"""The forwarder and the response it commits to, against a fault-injecting node: who counts what against the
node's circuit breaker, and when."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from qiip_core import FailoverExhausted, UpstreamError, UpstreamTimeout, UpstreamTransportError
from qiip_core.config import UpstreamSettings
from qiip_core.nodes import Node, NodeStatus
from qiip_core.routing import BreakerPolicy, Forwarder, RoutingTable
from qiip_core.upstream import UpstreamRequest
from qiip_core.upstream._http11 import NodeConnectError, NodeDisconnected, NodeResponse
from tests.support.fault_backend import FaultBackend, Hang, Json, Sse, Status

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


def request(*, stream: bool = True) -> UpstreamRequest:
    body = b'{"model": "m", "messages": [], "stream": %s}' % (b"true" if stream else b"false")
    return UpstreamRequest(
        path=CHAT, body=body, headers=[("content-type", "application/json")], model="m", stream=stream
    )


@pytest.fixture
def backend() -> Iterator[FaultBackend]:
    with FaultBackend(model="m") as node:
        yield node


@pytest.fixture
def table(backend: FaultBackend) -> RoutingTable:
    table = RoutingTable(breaker=BreakerPolicy(min_failures=5))
    table.apply_put(Node(id="n1", endpoint=backend.url, model="m"), source="config")
    table.set_liveness("n1", NodeStatus.HEALTHY)
    # One failure already counted, so a success shows as the count going back to 0.
    table.record_failure("n1", "earlier")
    return table


@pytest.fixture
async def forwarder(table: RoutingTable) -> AsyncIterator[Forwarder]:
    forwarder = Forwarder(table, UpstreamSettings(idle_timeout_s=30, ttfb_timeout_s=30), max_attempts=1)
    yield forwarder
    await forwarder.aclose()


def failures(table: RoutingTable) -> int:
    state = table.get("n1")
    assert state is not None
    return state.breaker.consecutive_failures


def in_flight(table: RoutingTable) -> int:
    state = table.get("n1")
    assert state is not None
    return state.in_flight


async def test_a_stream_read_to_its_end_is_the_nodes_success(
    backend: FaultBackend, table: RoutingTable, forwarder: Forwarder
) -> None:
    backend.push(Sse(n_events=3))
    upstream = await forwarder.open(request())
    body = upstream.prefix
    while chunk := await upstream.read():
        body += chunk
    assert body.endswith(b"data: [DONE]\n\n") and failures(table) == 1
    await upstream.aclose()
    await upstream.aclose()
    assert failures(table) == 0 and in_flight(table) == 0


async def test_a_whole_buffered_answer_is_the_nodes_success(
    backend: FaultBackend, table: RoutingTable, forwarder: Forwarder
) -> None:
    backend.push(Json(200, {"object": "chat.completion"}))
    upstream = await forwarder.open(request(stream=False))
    assert upstream.complete and await upstream.read() == b""
    await upstream.aclose()
    assert failures(table) == 0 and in_flight(table) == 0


async def test_a_stream_cut_after_its_first_event_counts_once_at_the_cut(
    backend: FaultBackend, table: RoutingTable, forwarder: Forwarder
) -> None:
    backend.push(Sse(n_events=5, reset_after_events=2, delay_between_s=0.05))
    upstream = await forwarder.open(request())
    with pytest.raises(UpstreamTransportError):
        while await upstream.read():
            pass
    assert failures(table) == 2
    await upstream.aclose()
    assert failures(table) == 2 and in_flight(table) == 0


async def test_a_stream_cut_before_its_first_event_is_counted_by_the_forwarder_alone(
    backend: FaultBackend, table: RoutingTable, forwarder: Forwarder
) -> None:
    backend.push(Sse(n_events=5, reset_after_events=0))
    with pytest.raises(UpstreamTransportError):
        await forwarder.open(request())
    assert failures(table) == 2 and in_flight(table) == 0


async def test_an_abandoned_answer_counts_neither_way(
    backend: FaultBackend, table: RoutingTable, forwarder: Forwarder
) -> None:
    backend.push(Sse(n_events=50, delay_between_s=0.05))
    upstream = await forwarder.open(request())
    await upstream.read()
    await upstream.aclose()
    assert failures(table) == 1 and in_flight(table) == 0
    await asyncio.to_thread(backend.wait_for_disconnect)


async def test_a_stream_slower_in_all_than_the_idle_limit_but_within_it_per_gap_goes_on(
    backend: FaultBackend, table: RoutingTable
) -> None:
    # Each gap (0.2 s) is well within the idle limit (1 s); the stream as a whole (about 1.2 s) is not.
    backend.push(Sse(n_events=6, delay_between_s=0.2))
    forwarder = Forwarder(table, UpstreamSettings(idle_timeout_s=1, ttfb_timeout_s=5), max_attempts=1)
    try:
        upstream = await forwarder.open(request())
        body = upstream.prefix
        while chunk := await upstream.read():
            body += chunk
        await upstream.aclose()
    finally:
        await forwarder.aclose()
    assert body.count(b"data: ") == 7 and body.endswith(b"data: [DONE]\n\n")
    assert failures(table) == 0 and in_flight(table) == 0


async def test_a_node_silent_after_several_events_times_out_and_counts_once(
    backend: FaultBackend, table: RoutingTable
) -> None:
    backend.push(Sse(n_events=10, delay_between_s=0.02, stall_after_events=4))
    forwarder = Forwarder(table, UpstreamSettings(idle_timeout_s=0.3, ttfb_timeout_s=5), max_attempts=1)
    try:
        upstream = await forwarder.open(request())
        body = upstream.prefix
        with pytest.raises(UpstreamTimeout, match="sent nothing for 0.3 s") as timed_out:
            while chunk := await upstream.read():
                body += chunk
        assert timed_out.value.request_sent and body.count(b"data: ") == 4
        assert failures(table) == 2
        await upstream.aclose()
    finally:
        await forwarder.aclose()
    assert failures(table) == 2 and in_flight(table) == 0
    await asyncio.to_thread(backend.wait_for_disconnect)


async def test_a_read_cancelled_from_outside_stays_cancelled(
    backend: FaultBackend, table: RoutingTable, forwarder: Forwarder
) -> None:
    # The client leaving cancels the relay's task while it waits on the node: a cancellation, never a timeout.
    backend.push(Sse(n_events=3, stall_after_events=1))
    upstream = await forwarder.open(request())
    reading = asyncio.ensure_future(upstream.read())
    await asyncio.sleep(0.05)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    await upstream.aclose()
    assert failures(table) == 1 and in_flight(table) == 0


async def test_a_4xx_answer_counts_neither_way(
    backend: FaultBackend, table: RoutingTable, forwarder: Forwarder
) -> None:
    backend.push(Status(400))
    upstream = await forwarder.open(request(stream=False))
    assert upstream.status_code == 400 and upstream.complete
    await upstream.aclose()
    assert failures(table) == 1 and in_flight(table) == 0


async def test_every_attempt_answering_5xx_counts_nothing(backend: FaultBackend, table: RoutingTable) -> None:
    second = Node(id="n2", endpoint=backend.url, model="m")
    table.apply_put(second, source="config")
    table.set_liveness("n2", NodeStatus.HEALTHY)
    backend.default = Status(503)
    forwarder = Forwarder(table, UpstreamSettings(), max_attempts=3)
    try:
        with pytest.raises(FailoverExhausted) as info:
            await forwarder.open(request())
    finally:
        await forwarder.aclose()
    assert info.value.attempts == 2 and failures(table) == 1 and in_flight(table) == 0


async def test_a_timeout_says_whether_the_node_had_the_request(backend: FaultBackend) -> None:
    # A node that holds the request: it had it.
    backend.push(Hang())
    table = RoutingTable(breaker=BreakerPolicy(min_failures=5))
    table.apply_put(Node(id="n1", endpoint=backend.url, model="m"), source="config")
    table.set_liveness("n1", NodeStatus.HEALTHY)
    forwarder = Forwarder(table, UpstreamSettings(ttfb_timeout_s=0.5), max_attempts=3)
    try:
        with pytest.raises(UpstreamTimeout) as held:
            await forwarder.open(request())
        assert held.value.request_sent and held.value.attempts == 1
        # A listening socket that never accepts (backlog full) stands for a node that does not answer the
        # handshake in time: the request never left, and every node may be tried.
        with socket.socket() as unanswered:
            unanswered.bind(("127.0.0.1", 0))
            unanswered.listen(0)
            host, port = unanswered.getsockname()
            fillers = [socket.socket() for _ in range(3)]
            for filler in fillers:
                filler.setblocking(False)
                filler.connect_ex((host, port))
            try:
                table.apply_put(Node(id="n2", endpoint=f"http://{host}:{port}", model="m"), source="config")
                table.set_liveness("n2", NodeStatus.HEALTHY)
                table.apply_delete("n1")
                with pytest.raises(FailoverExhausted) as unsent:
                    await forwarder.open(request())
                # Failed over (to no other node here), not ended at the first timeout.
                last = unsent.value.last
                assert isinstance(last, UpstreamTimeout) and not last.request_sent
            finally:
                for filler in fillers:
                    filler.close()
    finally:
        await forwarder.aclose()


STALE_CONNECTION_FAILURES = [
    NodeDisconnected("the node closed the connection before its answer's headers"),
    aiohttp.ServerDisconnectedError(),
    aiohttp.ClientOSError(104, "Connection reset by peer"),
    aiohttp.ClientConnectionResetError("Cannot write to closing transport"),
    aiohttp.ClientConnectionError("Failed to send bytes into the underlying connection"),
    ConnectionResetError(104, "Connection reset by peer"),
]
"""How the node client (and aiohttp, the client before it) fails a request written on a pooled connection the node
closed, or was closing, as it was handed out; each is seen before any response byte."""


def fail_first_pooled_send(forwarder: Forwarder, failure: BaseException) -> list[bool]:
    """Make the first pooled send raise `failure` (as the pool's race does); returns each send's `fresh`."""
    post = forwarder.client.post
    sends: list[bool] = []

    async def racing_post(*args: object, fresh: bool = False, **kwargs: object) -> NodeResponse:
        sends.append(fresh)
        if len(sends) == 1:
            raise failure
        return await post(*args, fresh=fresh, **kwargs)  # type: ignore[arg-type]

    forwarder.client.post = racing_post  # type: ignore[method-assign]
    return sends


@pytest.mark.parametrize("failure", STALE_CONNECTION_FAILURES, ids=lambda exc: type(exc).__name__)
async def test_a_send_on_a_closing_pooled_connection_is_sent_again_on_a_new_one_and_never_counts(
    backend: FaultBackend, table: RoutingTable, forwarder: Forwarder, failure: BaseException
) -> None:
    backend.push(Sse(n_events=2))
    sends = fail_first_pooled_send(forwarder, failure)
    upstream = await forwarder.open(request())
    body = upstream.prefix
    while chunk := await upstream.read():
        body += chunk
    await upstream.aclose()
    # One attempt (the only node), two sends: the second on a new connection; the node's answer is its success.
    assert sends == [False, True] and body.endswith(b"data: [DONE]\n\n")
    assert failures(table) == 0 and in_flight(table) == 0


@pytest.mark.parametrize(
    "failure",
    [
        NodeConnectError("cannot connect to 127.0.0.1:9: [Errno 111] Connection refused"),
        aiohttp.ClientConnectorError(
            aiohttp.client_reqrep.ConnectionKey("127.0.0.1", 9, False, True, None, None, None),
            ConnectionRefusedError(111, "Connection refused"),
        ),
        aiohttp.ServerTimeoutError("Timeout on reading data from socket"),
    ],
    ids=lambda exc: type(exc).__name__,
)
async def test_a_failed_connect_or_a_timeout_is_the_nodes_failure_not_a_stale_connection(
    backend: FaultBackend, table: RoutingTable, forwarder: Forwarder, failure: BaseException
) -> None:
    sends = fail_first_pooled_send(forwarder, failure)
    with pytest.raises(UpstreamError):
        await forwarder.open(request())
    assert sends == [False] and failures(table) == 2 and in_flight(table) == 0
