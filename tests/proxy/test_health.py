"""Health checks, llama-server's loading phase, and circuit-breaker recovery through a real probe."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.support.daemon import Daemon, wait_until
from tests.support.fault_backend import FaultBackend, Json, LoadingThenOk, Status

pytestmark = pytest.mark.integration

Backends = Callable[..., FaultBackend]
CHAT = "/v1/chat/completions"


def chat(daemon: Daemon, model: str) -> httpx.Response:
    return httpx.post(daemon.url + CHAT, json={"model": model, "messages": []}, timeout=30)


def test_loading_node_is_not_routable_until_ready(health_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    backend.health = LoadingThenOk(loading_s=1.5)
    node_id = f"{model}-n"
    health_daemon.add_node(node_id, backend.url, model, wait=False)
    wait_until(lambda: sum(r.path == "/health" for r in backend.requests) >= 3, what="a few loading probes")
    assert health_daemon.node_statuses()[node_id] == "unknown"
    answer = chat(health_daemon, model)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_unavailable"
    health_daemon.wait_status(node_id, "healthy")
    assert chat(health_daemon, model).status_code == 200


def test_failing_probes_demote_and_passing_probes_restore(
    health_daemon: Daemon, backends: Backends, model: str
) -> None:
    backend = backends()
    node_id = f"{model}-n"
    health_daemon.add_node(node_id, backend.url, model)
    backend.health = Status(500)
    health_daemon.wait_status(node_id, "unhealthy")
    backend.health = Json(200, {"status": "ok"})
    health_daemon.wait_status(node_id, "healthy")
    backend.stop_listening()
    health_daemon.wait_status(node_id, "unhealthy")
    backend.start_listening()
    health_daemon.wait_status(node_id, "healthy")


def test_open_breaker_closes_only_after_a_real_completion(
    health_daemon: Daemon, backends: Backends, model: str
) -> None:
    broken, fine = backends(), backends()
    node_id = f"{model}-broken"
    health_daemon.add_node(node_id, broken.url, model)
    health_daemon.add_node(f"{model}-fine", fine.url, model)
    broken.default = Status(500)

    def breaker_open() -> bool:
        return health_daemon.counter("qiip_node_breaker_open", node=node_id) == 1

    # Each time the broken node is tried first, the fine one answers after it: that 5xx counts.
    for _ in range(60):
        assert chat(health_daemon, model).status_code == 200
        if breaker_open():
            break
    wait_until(breaker_open, what="the broken node's breaker to open")
    # /health keeps answering 200, but the recovery probe (a one-token completion) still fails.
    wait_until(lambda: any(r.path == "/v1/completions" for r in broken.requests), what="a recovery probe")
    assert breaker_open()
    probe = next(r for r in broken.requests if r.path == "/v1/completions")
    assert probe.json == {"model": model, "prompt": "ping", "max_tokens": 1}
    broken.default = Json(200, {"object": "text_completion", "choices": []})
    wait_until(lambda: not breaker_open(), what="the breaker to close")
    assert health_daemon.node_statuses()[node_id] == "healthy"


def test_models_survive_a_dead_node(health_daemon: Daemon, backends: Backends, model: str) -> None:
    alive, dead = backends(), backends()
    health_daemon.add_node(f"{model}-alive", alive.url, model)
    health_daemon.add_node(f"{model}-dead", dead.url, model + "-other")
    dead.stop_listening()
    health_daemon.wait_status(f"{model}-dead", "unhealthy")
    listed = [m["id"] for m in httpx.get(health_daemon.url + "/v1/models", timeout=30).json()["data"]]
    assert model in listed and model + "-other" not in listed


def test_health_endpoint_counts_nodes(health_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    health_daemon.add_node(f"{model}-n", backend.url, model)
    health = httpx.get(health_daemon.url + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["registry"]["backend"] == "embedded"
    assert health["nodes_registered"] >= 1 and health["nodes_healthy"] >= 1
