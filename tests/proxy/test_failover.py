"""Failover before the first byte, error relaying and exhaustion, against a fault-injecting backend."""

from __future__ import annotations

import base64
import socket
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from tests.support.daemon import Daemon, wait_until
from tests.support.failover import body, busy, calls
from tests.support.fault_backend import Exchange, FaultBackend, Json, Sse, Status
from tests.support.openai_client import openai_client

pytestmark = pytest.mark.integration

Backends = Callable[..., FaultBackend]
CHAT = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}


def test_refused_connection_fails_over_to_another_node(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    dead, alive = backends(), backends()
    fault_daemon.add_node(f"{model}-alive", alive.url, model)
    with busy(fault_daemon, alive, model):
        fault_daemon.add_node(f"{model}-dead", dead.url, model)
        dead.stop_listening()
        response = httpx.post(fault_daemon.url + CHAT, json=body(model), timeout=30)
    assert response.status_code == 200 and response.json()["object"] == "chat.completion"
    assert fault_daemon.counter("qiip_upstream_retries_total", node=f"{model}-dead") == 1


def test_5xx_fails_over_and_trips_the_breaker(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    broken, alive = backends(), backends()
    broken.default = Status(500)
    fault_daemon.add_node(f"{model}-alive", alive.url, model)
    with busy(fault_daemon, alive, model):
        fault_daemon.add_node(f"{model}-broken", broken.url, model)
        for _ in range(3):
            assert httpx.post(fault_daemon.url + CHAT, json=body(model), timeout=30).status_code == 200
    assert calls(broken) >= 1
    # Three 5xx answers, each followed by another node's 200 on the same request: the breaker opens; the
    # node's liveness stays its health probes'.
    assert fault_daemon.counter("qiip_node_breaker_open", node=f"{model}-broken") == 1
    assert fault_daemon.node_statuses()[f"{model}-broken"] == "healthy"


def test_exhausted_failover_reports_attempts(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    nodes = [backends() for _ in range(4)]
    for index, backend in enumerate(nodes):
        backend.default = Status(503, b'{"error": "overloaded"}')
        fault_daemon.add_node(f"{model}-{index}", backend.url, model)
    response = httpx.post(fault_daemon.url + CHAT, json=body(model), timeout=30)
    assert response.status_code == 503
    assert response.headers["x-qiip-failover"] == "exhausted"
    assert response.headers["x-qiip-attempts"] == "3"
    error = response.json()["error"]
    assert error["code"] == "failover_exhausted" and error["type"] == "upstream_error"
    # The gateway's own words: the node's text stays in the log.
    assert "HTTP 503" in error["message"] and "overloaded" not in error["message"]
    assert sum(calls(b) for b in nodes) == 3
    assert "overloaded" in fault_daemon.log()


def test_exhausted_with_fewer_nodes_than_attempts(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    dead = backends()
    fault_daemon.add_node(f"{model}-dead", dead.url, model)
    dead.stop_listening()
    with pytest.raises(openai.APIStatusError) as info:
        openai_client(fault_daemon.url + "/v1").chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.status_code == 502
    assert info.value.response.headers["x-qiip-attempts"] == "1"
    assert info.value.code == "failover_exhausted"


def test_upstream_4xx_is_relayed_verbatim_and_not_retried(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    picky, other = backends(), backends()
    raw = b'{"error": {"message": "messages must alternate", "type": "invalid_request_error", "code": "x"}}'
    picky.default = Status(400, raw, headers={"x-node-detail": "kept"})
    other.default = Status(400, raw)
    fault_daemon.add_node(f"{model}-a", picky.url, model)
    fault_daemon.add_node(f"{model}-b", other.url, model)
    for _ in range(5):
        response = httpx.post(fault_daemon.url + CHAT, json=body(model), timeout=30)
        assert response.status_code == 400 and response.content == raw
    assert calls(picky) + calls(other) == 5
    assert fault_daemon.node_statuses()[f"{model}-a"] == "healthy"
    assert fault_daemon.node_statuses()[f"{model}-b"] == "healthy"
    assert fault_daemon.counter("qiip_upstream_retries_total", model=model) == 0


def test_429_is_relayed_with_retry_after(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    busy_node = backends()
    busy_node.default = Status(429, headers={"Retry-After": "7"})
    fault_daemon.add_node(f"{model}-a", busy_node.url, model)
    response = httpx.post(fault_daemon.url + CHAT, json=body(model), timeout=30)
    assert response.status_code == 429 and response.headers["retry-after"] == "7"
    assert calls(busy_node) == 1


@pytest.mark.parametrize(
    "slow_answer", [Json(200, {"late": True}, delay_s=3), Sse(delay_first_event_s=3)], ids=["answer", "stream"]
)
def test_a_node_that_times_out_with_the_request_is_not_replaced_by_another(
    fault_daemon: Daemon, backends: Backends, model: str, slow_answer: Json | Sse
) -> None:
    # The slow node had the whole request: another node would only repeat its work (no
    # routing.retry_after_timeout here; tests/proxy/test_timeouts.py has it on).
    slow, fast = backends(), backends()
    slow.default = slow_answer
    fault_daemon.add_node(f"{model}-fast", fast.url, model)
    with busy(fault_daemon, fast, model):
        fault_daemon.add_node(f"{model}-slow", slow.url, model)
        response = httpx.post(
            fault_daemon.url + CHAT, json=body(model, stream=isinstance(slow_answer, Sse)), timeout=30
        )
        assert response.status_code == 504 and response.headers["x-qiip-attempts"] == "1"
        error = response.json()["error"]
        assert error["code"] == "backend_timeout" and "routing.retry_after_timeout" in error["message"]
        assert calls(fast) == 1  # the request that keeps it busy, no other
    slow.wait_for_disconnect()


@pytest.mark.parametrize(
    "fault", [Sse(close_after_headers=True), Sse(reset_before_headers=True), Sse(events=[], done=False)]
)
def test_stream_that_dies_before_its_first_event_fails_over(
    fault_daemon: Daemon, backends: Backends, model: str, fault: Sse
) -> None:
    broken, fine = backends(), backends()
    broken.default = fault
    fault_daemon.add_node(f"{model}-fine", fine.url, model)
    with busy(fault_daemon, fine, model):
        fault_daemon.add_node(f"{model}-broken", broken.url, model)
        response = httpx.post(fault_daemon.url + CHAT, json=body(model, stream=True), timeout=30)
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    assert calls(broken) >= 1


def test_stale_pooled_connection_is_retried_on_the_same_node(
    fault_daemon: Daemon, backends: Backends, model: str
) -> None:
    backend = backends()
    fault_daemon.add_node(f"{model}-only", backend.url, model)
    assert httpx.post(fault_daemon.url + CHAT, json=body(model), timeout=30).status_code == 200
    first = backend.requests[-1]
    # The node now drops the next request that arrives on that kept-alive connection, as a server that
    # closes idle connections does when the close races the gateway's reuse.
    backend.push(_DropIfReused(first.connection))
    response = httpx.post(fault_daemon.url + CHAT, json=body(model), timeout=30)
    assert response.status_code == 200
    connections = [r.connection for r in backend.requests]
    assert connections[-2] == first.connection and connections[-1] != first.connection
    assert fault_daemon.node_statuses()[f"{model}-only"] == "healthy"


class _DropIfReused(Json):
    def __init__(self, connection: int) -> None:
        super().__init__()
        object.__setattr__(self, "headers", {"x-connection": str(connection)})

    async def respond(self, exchange: Exchange) -> None:
        if exchange.request.connection == int(self.headers["x-connection"]):
            exchange.reset()
            return
        await super().respond(exchange)


def test_gzip_answers_reach_the_client_decoded(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    payload = {"object": "chat.completion", "choices": [{"message": {"content": "é" * 5000}}]}
    backend.default = Json(200, payload, gzip=True)
    fault_daemon.add_node(f"{model}-gz", backend.url, model)
    response = httpx.post(fault_daemon.url + CHAT, json=body(model), timeout=30)
    assert response.status_code == 200 and response.json() == payload
    assert backend.requests[-1].headers["accept-encoding"] == "identity"


def test_gzip_stream_is_decoded_and_framed(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    import gzip

    events = [b'data: {"n": %d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]
    backend = backends()
    backend.default = Sse(writes=[gzip.compress(b"".join(events))], headers={"content-encoding": "gzip"})
    fault_daemon.add_node(f"{model}-gz", backend.url, model)
    response = httpx.post(fault_daemon.url + CHAT, json=body(model, stream=True), timeout=30)
    assert response.content == b"".join(events)
    assert "content-encoding" not in response.headers


def test_connections_are_reused(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    fault_daemon.add_node(f"{model}-a", backend.url, model)
    for _ in range(5):
        httpx.post(fault_daemon.url + CHAT, json=body(model), timeout=30)
    assert len({r.connection for r in backend.requests if r.path == CHAT}) == 1


def test_routing_errors(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    missing = httpx.post(fault_daemon.url + CHAT, json=body("no/such:model"), timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    down = backends()
    fault_daemon.add_node(f"{model}-down", down.url, model)
    down.health = Status(500)
    down.stop_listening()
    fault_daemon.add_node(f"{model}-down", down.url.replace(str(down.port), "1"), model, wait=False)
    wait_until(lambda: fault_daemon.node_statuses().get(f"{model}-down") == "unknown", what="the node to be unknown")
    unavailable = httpx.post(fault_daemon.url + CHAT, json=body(model), timeout=30)
    assert unavailable.status_code == 503 and unavailable.json()["error"]["code"] == "model_unavailable"
    models = httpx.get(fault_daemon.url + "/v1/models", timeout=30).json()["data"]
    assert model not in [m["id"] for m in models]
    one = httpx.get(fault_daemon.url + f"/v1/models/{model}", timeout=30)
    assert one.status_code == 503


def head_of(daemon: Daemon, request_line: str, headers: str) -> str:
    """What the daemon answers to a request's head alone (a body it declares and never gets)."""
    host, port = daemon.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"{request_line} HTTP/1.1\r\nHost: {host}\r\n{headers}\r\n".encode())
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer.decode(errors="replace")


def test_bad_requests(fault_daemon: Daemon) -> None:
    too_big = httpx.post(fault_daemon.url + CHAT, content=b"x" * (2 << 20), headers=JSON, timeout=30)
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:
        for _ in range(40):
            yield b"x" * 65536

    streamed = httpx.post(fault_daemon.url + CHAT, content=chunks(), headers=JSON, timeout=30)
    assert streamed.status_code == 413
    # Not JSON by its type: refused before a byte of the body is read.
    assert httpx.post(fault_daemon.url + CHAT, content=b"{}", timeout=30).json()["error"]["code"] == (
        "unsupported_media_type"
    )
    deep = b"[" * 100_000 + b"]" * 100_000
    for raw, code in (
        (b"[1, 2]", "invalid_json"),
        (b"{", "invalid_json"),
        (b'{"model": 5}', "missing_model"),
        (deep, "invalid_json"),
        (b'{"model": "m", "max_tokens": 1000000000000000000000000000000}', "invalid_value"),
        (b'{"model": "m", "max_completion_tokens": "5"}', "invalid_value"),
        (b'{"model": "m", "max_tokens": true}', "invalid_value"),
    ):
        answer = httpx.post(fault_daemon.url + CHAT, content=raw, headers=JSON, timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["code"] == code
    headers = {"content-type": "application/json"}
    admin = fault_daemon.admin.post("/admin/tokens", content=deep, headers=headers)
    # Over admin.max_body_bytes: refused from its Content-Length, before it is read.
    assert admin.status_code == 413 and admin.json()["error"]["code"] == "request_too_large"
    shallow_deep = b"[" * 20_000 + b"]" * 20_000
    admin = fault_daemon.admin.post("/admin/tokens", content=shallow_deep, headers=headers)
    assert admin.status_code in (400, 422)
    # A backup's restore takes more than admin.max_body_bytes, up to admin.max_restore_bytes, and only once the
    # credentials are checked: without them, the size it declares is never looked at.
    restore = fault_daemon.admin.post("/admin/state/restore?dry_run=true", content=shallow_deep, headers=headers)
    assert restore.status_code == 422 and restore.json()["error"]["code"] == "invalid_backup", restore.text
    declared = f"Content-Type: application/json\r\nContent-Length: {64 * 1024 * 1024 + 1}\r\n"
    assert head_of(fault_daemon, "POST /admin/state/restore", declared).startswith("HTTP/1.1 401")
    user, password = fault_daemon.env["QIIP_ADMIN__USERNAME"], fault_daemon.env["QIIP_ADMIN__PASSWORD"]
    basic = base64.b64encode(f"{user}:{password}".encode()).decode()
    refused = head_of(fault_daemon, "POST /admin/state/restore", declared + f"Authorization: Basic {basic}\r\n")
    assert refused.startswith("HTTP/1.1 413") and "admin.max_restore_bytes" in refused, refused
    assert httpx.get(fault_daemon.url + "/v1/nothing", timeout=30).json()["error"]["code"] == "not_found"


def test_a_request_every_node_answers_5xx_moves_no_breaker(
    fault_daemon: Daemon, backends: Backends, model: str
) -> None:
    # A request that makes every node fail (a part llama-server chokes on) must not let one client take the
    # model's nodes out of rotation.
    nodes = [backends(), backends()]
    for index, backend in enumerate(nodes):
        backend.default = Status(500)
        fault_daemon.add_node(f"{model}-{index}", backend.url, model)
    for _ in range(5):
        answer = httpx.post(fault_daemon.url + CHAT, json=body(model), timeout=30)
        assert answer.status_code == 500 and answer.json()["error"]["code"] == "failover_exhausted"
    assert {fault_daemon.node_statuses()[f"{model}-{i}"] for i in range(2)} == {"healthy"}


def test_501_is_retried_elsewhere_and_never_counted(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    lacking, able = backends(), backends()
    lacking.default = Status(501)
    fault_daemon.add_node(f"{model}-able", able.url, model)
    with busy(fault_daemon, able, model):
        fault_daemon.add_node(f"{model}-lacking", lacking.url, model)
        for _ in range(4):
            assert httpx.post(fault_daemon.url + CHAT, json=body(model), timeout=30).status_code == 200
    assert fault_daemon.node_statuses()[f"{model}-lacking"] == "healthy"


def test_requests_go_only_to_nodes_that_serve_their_api(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    chat_only = backends()
    fault_daemon.add_node(f"{model}-chat", chat_only.url, model, endpoints=("chat", "completions"))
    answer = httpx.post(fault_daemon.url + "/v1/embeddings", json={"model": model, "input": "x"}, timeout=30)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "endpoint_not_supported" and "chat, completions" in error["message"]
    assert calls(chat_only) == 0


def test_what_a_node_says_stays_out_of_answers_and_is_escaped_in_the_log(
    fault_daemon: Daemon, backends: Backends, model: str
) -> None:
    echoing = backends()
    # A node that echoes the request's credentials and forges a log line.
    echoing.default = Status(500, b"got Authorization: Bearer sk-node-secret\n2026-01-01 [info] forged line")
    fault_daemon.add_node(f"{model}-echo", echoing.url, model)
    refused = backends()
    refused_url = refused.url
    refused.close()
    fault_daemon.add_node(f"{model}-gone", refused_url, model, wait=False)
    answers = [
        httpx.post(fault_daemon.url + "/v1/chat/completions", json={"model": model, "messages": []}, timeout=30)
        for _ in range(3)
    ]
    for answer in answers:
        assert answer.status_code >= 500
        assert "sk-node-secret" not in answer.text and "forged" not in answer.text
        assert refused_url.split("//")[1] not in answer.text  # no node address either
    log = fault_daemon.log()
    assert "sk-node-secret" not in log and "Bearer [redacted]" in log
    assert "\n2026-01-01 [info] forged line" not in log and "\\x0a2026-01-01" in log
