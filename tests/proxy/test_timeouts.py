"""Timeouts do not multiply load: a re-send after a timeout only when the operator opts in, healthy nodes
charged once per request, and one deadline for the whole request."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.support.daemon import Daemon
from tests.support.failover import CHAT, body, calls
from tests.support.fault_backend import FaultBackend, Sse

pytestmark = pytest.mark.integration

Backends = Callable[..., FaultBackend]


@pytest.fixture(scope="module")
def retry_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon that re-sends timed-out requests, whose breakers open at the first counted failure, and
    whose requests may take 2.5 s in all."""
    env = {
        "QIIP_HEALTH__INTERVAL_S": "60",
        "QIIP_UPSTREAM__TTFB_TIMEOUT_S": "1",
        "QIIP_UPSTREAM__IDLE_TIMEOUT_S": "1",
        "QIIP_UPSTREAM__REQUEST_DEADLINE_S": "2.5",
        "QIIP_ROUTING__RETRY_AFTER_TIMEOUT": "true",
        "QIIP_BREAKER__FAILURE_THRESHOLD": "1",
    }
    with Daemon(tmp_path_factory.mktemp("retry-daemon"), env=env) as daemon:
        yield daemon


def breakers_open(daemon: Daemon, prefix: str) -> int:
    """Open breakers among the nodes whose names start with `prefix`."""
    found = re.findall(rf'^qiip_node_breaker_open\{{node="{re.escape(prefix)}[^"]*"\}} 1\.0$', daemon.metrics(), re.M)
    return len(found)


def test_with_retry_after_timeout_a_slow_node_is_replaced(retry_daemon: Daemon, backends: Backends, model: str) -> None:
    slow, fast = backends(), backends()
    # The conversation's first turn, quick, on the slow node alone: prefix affinity (this daemon's policy) sends
    # the next turn there first, with no time limit on that choice (the request's 2.5 s deadline would end a
    # request held on the other node to keep it busy).
    slow.push(Sse())
    slow.default = Sse(delay_first_event_s=3)
    retry_daemon.add_node(f"{model}-slow", slow.url, model)
    first = httpx.post(retry_daemon.url + CHAT, json=body(model, stream=True), timeout=30)
    assert first.status_code == 200 and first.text.endswith("data: [DONE]\n\n")
    retry_daemon.add_node(f"{model}-fast", fast.url, model)
    response = httpx.post(retry_daemon.url + CHAT, json=body(model, stream=True), timeout=30)
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    assert calls(slow) == 2 and calls(fast) == 1
    assert breakers_open(retry_daemon, f"{model}-slow") == 1  # its timeout, the request's first, counted


def test_timeouts_of_healthy_nodes_count_once_and_the_deadline_ends_the_attempts(
    retry_daemon: Daemon, backends: Backends, model: str
) -> None:
    slow = [backends() for _ in range(3)]
    for index, backend in enumerate(slow):
        backend.default = Sse(delay_first_event_s=5)
        retry_daemon.add_node(f"{model}-{index}", backend.url, model)
    response = httpx.post(retry_daemon.url + CHAT, json=body(model, stream=True), timeout=30)
    # Two full first-token limits (1 s each), then the third attempt has what is left of 2.5 s.
    assert response.status_code == 504 and response.headers["x-qiip-attempts"] == "3"
    assert "x-qiip-failover" not in response.headers
    assert "the request's deadline" in response.json()["error"]["message"]
    assert sum(calls(backend) for backend in slow) == 3
    # All three nodes still pass their probes: the request, not the nodes, is the likely cause.
    assert breakers_open(retry_daemon, model) == 1


def test_the_request_deadline_ends_a_running_stream(retry_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    backend.default = Sse(n_events=20, delay_between_s=0.5)
    retry_daemon.add_node(f"{model}-n", backend.url, model)
    response = httpx.post(retry_daemon.url + CHAT, json=body(model, stream=True), timeout=30)
    events = [event for event in response.text.split("\n\n") if event]
    assert response.status_code == 200 and 2 <= len(events) - 2 < 20
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "backend_timeout" and "deadline" in error["message"]
    assert events[-1] == "data: [DONE]"
    backend.wait_for_disconnect()


def test_a_stream_whose_node_goes_silent_ends_with_an_error_event(
    retry_daemon: Daemon, backends: Backends, model: str
) -> None:
    backend = backends()
    backend.default = Sse(n_events=10, delay_between_s=0.05, stall_after_events=4)
    retry_daemon.add_node(f"{model}-n", backend.url, model)
    response = httpx.post(retry_daemon.url + CHAT, json=body(model, stream=True), timeout=30)
    events = [event for event in response.text.split("\n\n") if event]
    # The four events the node sent, then the idle limit's error event and `[DONE]`.
    assert response.status_code == 200 and len(events) == 6
    assert [json.loads(event.removeprefix("data: "))["choices"][0]["delta"]["content"] for event in events[:4]] == [
        f"tok{i} " for i in range(4)
    ]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "backend_timeout" and "sent nothing for 1 s" in error["message"]
    assert events[-1] == "data: [DONE]"
    backend.wait_for_disconnect()
    assert breakers_open(retry_daemon, f"{model}-n") == 1  # the node's failure, counted
