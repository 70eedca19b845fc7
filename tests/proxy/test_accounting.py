"""What one request leaves behind when it ends: the node's circuit breaker, and one record in the metrics."""

from __future__ import annotations

import socket
from collections.abc import Callable

import httpx
import pytest

from tests.support.daemon import Daemon, wait_until
from tests.support.fault_backend import FaultBackend, Json, Sse, Status

pytestmark = pytest.mark.integration

Backends = Callable[..., FaultBackend]
CHAT = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}


def stream_body(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}


def failures(daemon: Daemon, node_id: str) -> int:
    """The node's consecutive failures as its circuit breaker counts them."""
    count: int = daemon.admin.get(f"/admin/nodes/{node_id}").json()["breaker"]["consecutive_failures"]
    return count


def cut_stream(daemon: Daemon, backend: FaultBackend, model: str) -> None:
    """One stream the node breaks after its second event."""
    backend.push(Sse(n_events=5, reset_after_events=2))
    response = httpx.post(daemon.url + CHAT, json=stream_body(model), timeout=30)
    assert response.status_code == 200 and response.content.endswith(b"data: [DONE]\n\n")


def test_a_cut_stream_counts_once_against_its_node_and_a_whole_one_clears_it(
    fault_daemon: Daemon, backends: Backends, model: str
) -> None:
    backend = backends()
    node = f"{model}-n"
    fault_daemon.add_node(node, backend.url, model)
    cut_stream(fault_daemon, backend, model)
    assert failures(fault_daemon, node) == 1
    labels = {"model": model, "node": node}
    assert fault_daemon.counter("qiip_request_errors_total", code="backend_transport_error", **labels) == 1
    assert fault_daemon.counter("qiip_requests_total", status="200", **labels) == 1
    assert fault_daemon.counter("qiip_time_to_first_token_seconds_count", **labels) == 1
    assert fault_daemon.counter("qiip_request_duration_seconds_count", **labels) == 1

    whole = httpx.post(fault_daemon.url + CHAT, json=stream_body(model), timeout=30)
    assert whole.status_code == 200 and whole.content.endswith(b"data: [DONE]\n\n")
    assert failures(fault_daemon, node) == 0
    assert fault_daemon.counter("qiip_requests_total", status="200", **labels) == 2
    assert fault_daemon.counter("qiip_request_errors_total", **labels) == 1
    assert fault_daemon.counter("qiip_time_to_first_token_seconds_count", **labels) == 2


def test_a_cut_body_breaks_the_connection_and_counts_against_its_node(
    fault_daemon: Daemon, backends: Backends, model: str
) -> None:
    backend = backends()
    node = f"{model}-n"
    fault_daemon.add_node(node, backend.url, model)
    # Over `upstream.buffer_response_bytes` (1 MiB): relayed as it comes, so the cut comes after the headers.
    piece = b" " * 600_000
    backend.push(
        Sse(
            writes=[piece, piece, piece],
            reset_after_events=2,
            delay_between_s=0.2,
            headers={"content-type": "application/json"},
        )
    )
    with pytest.raises(httpx.HTTPError):
        httpx.post(fault_daemon.url + CHAT, json={"model": model, "messages": []}, timeout=30)
    wait_until(lambda: fault_daemon.in_flight(node) == 0, what="the reservation to be released")
    assert failures(fault_daemon, node) == 1
    labels = {"model": model, "node": node}
    assert fault_daemon.counter("qiip_requests_total", status="200", **labels) == 1
    assert fault_daemon.counter("qiip_time_to_first_token_seconds_count", **labels) == 0


def test_a_4xx_answer_neither_counts_nor_clears(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    node = f"{model}-n"
    fault_daemon.add_node(node, backend.url, model)
    cut_stream(fault_daemon, backend, model)
    backend.push(Status(400))
    assert httpx.post(fault_daemon.url + CHAT, json={"model": model}, timeout=30).status_code == 400
    assert failures(fault_daemon, node) == 1
    backend.push(Json(200, {"object": "chat.completion"}))
    assert httpx.post(fault_daemon.url + CHAT, json={"model": model}, timeout=30).status_code == 200
    assert failures(fault_daemon, node) == 0
    assert fault_daemon.counter("qiip_requests_total", model=model, node=node, status="400") == 1


def test_a_client_leaving_mid_stream_counts_neither_way(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    node = f"{model}-n"
    fault_daemon.add_node(node, backend.url, model)
    cut_stream(fault_daemon, backend, model)
    backend.push(Sse(n_events=100, delay_between_s=0.2))
    body = b'{"model": "%s", "messages": [], "stream": true}' % model.encode()
    with socket.create_connection(("127.0.0.1", fault_daemon.port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        received = b""
        while b"data: " not in received:
            piece = sock.recv(65536)
            assert piece, received
            received += piece
    backend.wait_for_disconnect()
    wait_until(lambda: fault_daemon.in_flight(node) == 0, what="the reservation to be released")
    assert failures(fault_daemon, node) == 1
    labels = {"model": model, "node": node}
    assert fault_daemon.counter("qiip_request_errors_total", code="client_disconnected", **labels) == 1
    assert fault_daemon.counter("qiip_time_to_first_token_seconds_count", **labels) == 2
    # The console's error share: the cut stream is the model's error, a client that went away is not.
    by_model = fault_daemon.admin.get("/admin/metrics").json()["by_model"][model]
    assert by_model["requests"] == 2 and by_model["errors"] == 1


def test_refusals_are_accounted_without_the_model_or_a_node(
    fault_daemon: Daemon, backends: Backends, model: str
) -> None:
    def count(**labels: str) -> float:
        return fault_daemon.counter("qiip_request_errors_total", model="", node="", **labels)

    invalid, missing = count(code="invalid_json"), count(code="model_not_found")
    assert httpx.post(fault_daemon.url + CHAT, content=b"{", headers=JSON, timeout=30).status_code == 400
    assert httpx.post(fault_daemon.url + CHAT, json={"model": model}, timeout=30).status_code == 404
    assert count(code="invalid_json") == invalid + 1
    assert count(code="model_not_found") == missing + 1


def test_exhausted_failover_counts_each_retried_node(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    nodes = [backends() for _ in range(3)]
    for index, backend in enumerate(nodes):
        backend.default = Status(503)
        fault_daemon.add_node(f"{model}-{index}", backend.url, model)
    response = httpx.post(fault_daemon.url + CHAT, json={"model": model}, timeout=30)
    assert response.status_code == 503 and response.headers["x-qiip-attempts"] == "3"
    assert fault_daemon.counter("qiip_upstream_retries_total", model=model) == 2
    assert fault_daemon.counter("qiip_request_errors_total", model=model, node="", code="failover_exhausted") == 1
    assert fault_daemon.counter("qiip_requests_total", model=model, node="", status="503") == 1
    # Every node answered 5xx: the request is the likely cause, and no breaker moved.
    assert [failures(fault_daemon, f"{model}-{i}") for i in range(3)] == [0, 0, 0]
