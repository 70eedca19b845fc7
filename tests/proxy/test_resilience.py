"""Resilience: a blip never takes a model down, retries never reuse a dead connection, and errors say when to
come back."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest

from tests.support.daemon import Daemon, wait_until
from tests.support.failover import CHAT, body, busy, calls
from tests.support.fault_backend import FaultBackend, Hang, Sse, Status
from tests.support.workers import Connections, answer, ask, start_with_workers

pytestmark = pytest.mark.integration

Backends = Callable[..., FaultBackend]


@pytest.fixture(scope="module")
def steady_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon with the default breaker and a slow health tick: only the breakers' own timers and trials
    bring nodes back. Least-connections spreads the tests' identical requests over the nodes (prefix
    affinity would keep them on the node that answered the first)."""
    env = {"QIIP_HEALTH__INTERVAL_S": "60", "QIIP_BREAKER__OPEN_S": "0.3", "QIIP_ROUTING__POLICY": "least_connections"}
    with Daemon(tmp_path_factory.mktemp("steady-daemon"), env=env) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def two_process_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The steady daemon's settings with two serving processes: each keeps its own pool of node connections."""
    env = {"QIIP_HEALTH__INTERVAL_S": "60", "QIIP_ROUTING__POLICY": "least_connections", "QIIP_SERVER__WORKERS": "2"}
    daemon = Daemon(tmp_path_factory.mktemp("two-process-daemon"), env=env)
    try:
        yield start_with_workers(daemon)
    finally:
        daemon.close()


@pytest.mark.parametrize("gateway", ["steady_daemon", "two_process_daemon"], ids=["one-process", "two-processes"])
def test_a_thousand_streams_through_a_node_that_closes_after_each_answer_all_succeed(
    gateway: str, backends: Backends, model: str, request: pytest.FixtureRequest
) -> None:
    # llama-server closes the connection after each streamed answer though its answer said keep-alive: every
    # pooled connection the gateway reuses races that close. A request that loses the race (on the write, or
    # before any response byte) is sent again on a new connection; the client never sees it and the node is
    # never blamed. With one node there is nowhere to fail over, so any miss would reach the client.
    daemon: Daemon = request.getfixturevalue(gateway)
    node = backends()
    node.default = Sse(n_events=2, close_after_end=True, headers={"Keep-Alive": "timeout=5"})
    daemon.add_node(f"{model}-n", node.url, model)
    if gateway == "two_process_daemon":
        # Both processes route the node before the load starts (each keeps its own table and pool).
        connections = Connections(daemon)
        try:
            for pid in connections.pids:
                wait_until(partial(served, connections, pid, model), what=f"process {pid} to route {model}")
        finally:
            connections.close()

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=8)
        async with httpx.AsyncClient(base_url=daemon.url, timeout=30, limits=limits) as client:
            semaphore = asyncio.Semaphore(8)

            async def one() -> httpx.Response:
                async with semaphore:
                    return await client.post(CHAT, json=body(model, stream=True))

            return await asyncio.gather(*(one() for _ in range(1000)))

    answers = asyncio.run(run())
    assert [a.status_code for a in answers].count(200) == 1000
    assert all(a.text.endswith("data: [DONE]\n\n") and '"error"' not in a.text for a in answers)
    assert daemon.counter("qiip_upstream_errors_total", node=f"{model}-n") == 0


def served(connections: Connections, pid: int, model: str) -> bool:
    """Whether process `pid` answered a chat request for `model` with 200, on a new connection it serves."""
    connection = connections.on(pid)
    ask(connection, model)
    return answer(connection)[0] == 200


def test_concurrent_failures_in_one_blip_do_not_open_a_breaker(
    steady_daemon: Daemon, backends: Backends, model: str
) -> None:
    node = backends()
    steady_daemon.add_node(f"{model}-n", node.url, model)
    # Eight requests in flight together all get a 500 from the same blip, then the node answers again.
    gate = threading.Barrier(8)
    for _ in range(8):
        node.push(Status(500))

    def one() -> None:
        gate.wait()
        httpx.post(steady_daemon.url + CHAT, json=body(model), timeout=30)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    # One node answering 5xx alone counts nothing (the request may be the cause); what matters is that the
    # node still serves.
    assert httpx.post(steady_daemon.url + CHAT, json=body(model), timeout=30).status_code == 200


def test_refusals_open_the_breaker_and_its_own_timer_brings_the_node_back(
    steady_daemon: Daemon, backends: Backends, model: str
) -> None:
    flaky, steady = backends(), backends()
    steady_daemon.add_node(f"{model}-flaky", flaky.url, model)
    steady_daemon.add_node(f"{model}-steady", steady.url, model)
    flaky.stop_listening(drop_connections=True)
    # Least connections breaks ties at random: go on until the refused node was tried often enough.
    for _ in range(100):
        assert httpx.post(steady_daemon.url + CHAT, json=body(model), timeout=30).status_code == 200
        if steady_daemon.counter("qiip_node_breaker_open", node=f"{model}-flaky") == 1:
            break
    assert steady_daemon.counter("qiip_node_breaker_open", node=f"{model}-flaky") == 1
    # The node is back; no health probe comes for a minute, yet its breaker's trial lets it in again.
    flaky.start_listening()
    before = calls(flaky)
    deadline = 200
    while calls(flaky) == before and deadline:
        httpx.post(steady_daemon.url + CHAT, json=body(model), timeout=30)
        deadline -= 1
    assert calls(flaky) > before
    assert steady_daemon.counter("qiip_node_breaker_open", node=f"{model}-flaky") == 0


def test_when_every_breaker_is_open_requests_are_still_tried(
    steady_daemon: Daemon, backends: Backends, model: str
) -> None:
    only = backends()
    steady_daemon.add_node(f"{model}-only", only.url, model)
    for _ in range(3):
        only.push(Status(502))
    statuses = [httpx.post(steady_daemon.url + CHAT, json=body(model), timeout=30).status_code for _ in range(4)]
    # One node, 5xx answers: the request may be at fault, so nothing counts and every request is tried.
    assert statuses == [502, 502, 502, 200]
    only.stop_listening(drop_connections=True)
    failed = [httpx.post(steady_daemon.url + CHAT, json=body(model), timeout=30) for _ in range(4)]
    assert steady_daemon.counter("qiip_node_breaker_open", node=f"{model}-only") == 1
    # Refused connections opened its breaker, yet each request still tried it: an honest 502, with when to
    # come back, and no 503 without a try.
    assert {answer.status_code for answer in failed} == {502}
    assert all(int(answer.headers["retry-after"]) >= 1 for answer in failed[3:])
    only.start_listening()
    assert httpx.post(steady_daemon.url + CHAT, json=body(model), timeout=30).status_code == 200


def test_retry_after_stays_within_the_breaker_s_period_however_many_requests_fail(
    tmp_path: Path, backends: Backends, model: str
) -> None:
    # A breaker's first open period of 20 s, and no health probe for a minute: before, each request's failed last
    # chance doubled the period it announced (20, 40, 80, … s).
    env = {"QIIP_HEALTH__INTERVAL_S": "60", "QIIP_BREAKER__OPEN_S": "20", "QIIP_BREAKER__OPEN_MAX_S": "600"}
    with Daemon(tmp_path, env=env) as daemon:
        only = backends()
        daemon.add_node(f"{model}-only", only.url, model)
        only.stop_listening(drop_connections=True)
        failed = [httpx.post(daemon.url + CHAT, json=body(model), timeout=30) for _ in range(8)]
        assert {answer.status_code for answer in failed} == {502}
        assert daemon.counter("qiip_node_breaker_open", node=f"{model}-only") == 1
        announced = [int(answer.headers["retry-after"]) for answer in failed if "retry-after" in answer.headers]
        assert len(announced) >= 5 and all(1 <= seconds <= 20 for seconds in announced), announced
        # The node back: the next request tries it, whatever was announced.
        only.start_listening()
        assert httpx.post(daemon.url + CHAT, json=body(model), timeout=30).status_code == 200


def test_an_unavailable_model_says_which_nodes_serve_it_and_when_to_retry(
    steady_daemon: Daemon, backends: Backends, model: str
) -> None:
    backend = backends()
    backend.health = Status(500)
    steady_daemon.add_node(f"{model}-down", backend.url, model, wait=False)
    steady_daemon.wait_status(f"{model}-down", "unhealthy")
    answer = httpx.post(steady_daemon.url + CHAT, json=body(model), timeout=30)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_unavailable"
    assert "1 node: 1 unhealthy" in answer.json()["error"]["message"]
    assert answer.headers["retry-after"] == "60"  # the next health probe


@pytest.fixture(scope="module")
def probing_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose probes find a hung node within about two seconds, and whose request limits (10 s) are
    far longer."""
    env = {
        "QIIP_HEALTH__INTERVAL_S": "1",
        "QIIP_HEALTH__TIMEOUT_S": "0.5",
        "QIIP_HEALTH__FAILURE_THRESHOLD": "2",
        "QIIP_HEALTH__RETRY_INTERVAL_S": "0.2",
    }
    with Daemon(tmp_path_factory.mktemp("probing-daemon"), env=env) as daemon:
        yield daemon


def test_a_request_waiting_on_a_hung_node_fails_over_when_its_probes_fail(
    probing_daemon: Daemon, backends: Backends, model: str
) -> None:
    hung, fine = backends(), backends()
    probing_daemon.add_node(f"{model}-fine", fine.url, model)
    with busy(probing_daemon, fine, model):
        probing_daemon.add_node(f"{model}-hung", hung.url, model)
        hung.health = Hang()
        hung.default = Hang()
        answer = httpx.post(probing_daemon.url + CHAT, json=body(model), timeout=30)
    # Without the probes it would have waited out the 10 s limit, then got a 504 (a timeout of a node that
    # had the request is not re-sent).
    assert answer.status_code == 200 and answer.json()["object"] == "chat.completion"
    assert calls(hung) == 1


def test_a_stream_from_a_node_that_hangs_ends_with_an_error_event(
    probing_daemon: Daemon, backends: Backends, model: str
) -> None:
    hung = backends()
    probing_daemon.add_node(f"{model}-hung", hung.url, model)
    hung.default = Sse(n_events=5, delay_between_s=60)
    hung.health = Hang()
    answer = httpx.post(probing_daemon.url + CHAT, json=body(model, stream=True), timeout=30)
    events = [event for event in answer.text.split("\n\n") if event]
    assert answer.status_code == 200 and len(events) == 3 and events[-1] == "data: [DONE]"
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["code"] == "backend_transport_error" and "health probes" in error["message"]
