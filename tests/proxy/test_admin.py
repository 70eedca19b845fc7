"""The admin API against the running daemon: credentials, the JSON boundary, inventory, lifecycle, events."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.daemon import Daemon, wait_until
from tests.support.fault_backend import FaultBackend, Sse, Status

pytestmark = pytest.mark.integration

Backends = Callable[..., FaultBackend]

ROUTES = [
    ("GET", "/admin/nodes"),
    ("GET", "/admin/nodes/x"),
    ("POST", "/admin/nodes"),
    ("POST", "/admin/nodes/x/drain"),
    ("POST", "/admin/nodes/x/undrain"),
    ("DELETE", "/admin/nodes/x"),
    ("POST", "/admin/nodes/x/llamacpp/relaunch"),
    ("GET", "/admin/operations"),
    ("GET", "/admin/operations/op_1"),
    ("GET", "/admin/metrics"),
    ("GET", "/admin/events"),
    ("GET", "/admin/tokens"),
    ("POST", "/admin/tokens"),
    ("DELETE", "/admin/tokens/tok_1"),
    ("GET", "/admin/attached"),
    ("POST", "/admin/attached/x"),
    ("GET", "/admin/models/catalog"),
    ("POST", "/admin/models/download"),
    ("GET", "/admin/models/downloads"),
    ("GET", "/admin/models/downloads/dl_1"),
    ("GET", "/admin/models/manifests"),
    ("POST", "/admin/models/manifests"),
    ("GET", "/admin/models/manifests/rev_1"),
    ("POST", "/admin/models/manifests/rev_1/acquire"),
    ("POST", "/admin/models/manifests/rev_1/pause"),
    ("POST", "/admin/models/manifests/rev_1/verify"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_every_admin_route_requires_the_credentials(fault_daemon: Daemon, method: str, path: str) -> None:
    for auth in (None, ("admin", "wrong"), ("other", "test-password"), ("", "")):
        answer = httpx.request(method, fault_daemon.url + path, auth=auth, json={}, timeout=30)
        assert answer.status_code == 401, (auth, answer.text)
        assert answer.headers["www-authenticate"].startswith("Basic")
        assert answer.json()["error"]["code"] == "unauthorized"


def test_state_changes_accept_json_only_and_no_unknown_fields(fault_daemon: Daemon) -> None:
    admin = fault_daemon.admin
    form = admin.post("/admin/nodes", content=b"id=x", headers={"content-type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415
    plain = admin.post("/admin/nodes/x/drain", content=b"{}", headers={"content-type": "text/plain"})
    assert plain.status_code == 415
    extra = admin.post("/admin/nodes", json={"id": "n", "endpoint": "http://127.0.0.1:1", "model": "m", "sneaky": True})
    assert extra.status_code == 422 and extra.json()["error"]["type"] == "invalid_request_error"


def test_register_inspect_drain_undrain_and_remove(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    admin = fault_daemon.admin
    backend = backends()
    created = admin.post("/admin/nodes", json={"id": f"{model}-n", "endpoint": backend.url, "model": model})
    assert created.status_code == 201 and created.json()["endpoint"] == backend.url
    fault_daemon.wait_status(f"{model}-n", "healthy")
    view = admin.get(f"/admin/nodes/{model}-n").json()
    assert view["status"] == "healthy" and view["in_flight"] == 0 and view["breaker"]["state"] == "closed"
    assert view["health"]["last_probe_at"] is not None and view["source"] == "state"
    assert any(n["id"] == f"{model}-n" for n in admin.get("/admin/nodes").json()["nodes"])

    operation = admin.post(f"/admin/nodes/{model}-n/drain", json={"timeout_s": 5})
    assert operation.status_code == 202
    done = _finished(fault_daemon, operation.json()["id"])
    assert done["state"] == "succeeded" and done["result"] == {"remaining_in_flight": 0, "timed_out": False}
    assert admin.post(f"/admin/nodes/{model}-n/drain", json={}).status_code == 409
    chat = httpx.post(fault_daemon.url + "/v1/chat/completions", json={"model": model, "messages": []}, timeout=30)
    assert chat.status_code == 503
    undrained = admin.post(f"/admin/nodes/{model}-n/undrain", json={})
    assert undrained.status_code == 200
    fault_daemon.wait_status(f"{model}-n", "healthy")
    assert admin.post(f"/admin/nodes/{model}-n/undrain", json={}).status_code == 409

    removal = admin.delete(f"/admin/nodes/{model}-n")
    assert removal.status_code == 202
    assert _finished(fault_daemon, removal.json()["id"])["state"] == "succeeded"
    fault_daemon.wait_gone(f"{model}-n")
    assert admin.get(f"/admin/nodes/{model}-n").status_code == 404
    assert admin.post("/admin/nodes/ghost/drain", json={}).status_code == 404
    assert admin.delete("/admin/nodes/ghost").status_code == 404


def test_register_refuses_endpoints_outside_the_allowlist(fault_daemon: Daemon) -> None:
    for endpoint in (
        "http://10.0.0.1:8000",
        "http://[::ffff:10.0.0.1]:8000",
        "http://2130706433:8000",
        "http://0177.0.0.1:8000",
        "http://user:pw@127.0.0.1:8000",
        "http://127.0.0.1@10.0.0.1:8000",
        "http://127.0.0.1:8000/v1",
        "http://127.0.0.1",
    ):
        answer = fault_daemon.admin.post("/admin/nodes", json={"id": "x", "endpoint": endpoint, "model": "m"})
        assert answer.status_code == 400, endpoint
        assert answer.json()["error"]["param"] == "endpoint"


def test_drain_under_load_lets_streams_finish_and_sends_nothing_new(
    fault_daemon: Daemon, backends: Backends, model: str
) -> None:
    slow, other = backends(), backends()
    slow.default = Sse(n_events=8, delay_between_s=0.25)
    fault_daemon.add_node(f"{model}-slow", slow.url, model)
    streams: list[bytes] = []

    def stream() -> None:
        body = {"model": model, "messages": [], "stream": True}
        streams.append(httpx.post(fault_daemon.url + "/v1/chat/completions", json=body, timeout=30).content)

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for thread in threads:
        thread.start()
    wait_until(lambda: fault_daemon.in_flight(f"{model}-slow") == 3, what="three streams in flight")
    fault_daemon.add_node(f"{model}-other", other.url, model)
    operation = fault_daemon.admin.post(f"/admin/nodes/{model}-slow/drain", json={"timeout_s": 20}).json()
    before = sum(1 for r in slow.requests if r.path.startswith("/v1/"))
    for _ in range(5):
        answer = httpx.post(fault_daemon.url + "/v1/chat/completions", json={"model": model, "messages": []})
        assert answer.status_code == 200
    assert sum(1 for r in slow.requests if r.path.startswith("/v1/")) == before
    for thread in threads:
        thread.join(30)
    assert all(s.endswith(b"data: [DONE]\n\n") and s.count(b"data: {") == 8 for s in streams)
    done = _finished(fault_daemon, operation["id"])
    assert done["result"]["remaining_in_flight"] == 0


def test_events_stream_node_changes_with_heartbeats(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    with fault_daemon.admin.stream("GET", "/admin/events", params={"heartbeat_s": 0.2}) as events:
        lines = events.iter_lines()
        fault_daemon.add_node(f"{model}-n", backend.url, model, wait=False)
        seen: list[dict[str, Any]] = []
        heartbeats = 0
        for line in lines:
            if line.startswith(": heartbeat"):
                heartbeats += 1
            elif line.startswith("data: "):
                seen.append(json.loads(line[6:]))
            if heartbeats >= 1 and any(
                e["change"] in ("added", "updated")
                and e["node"]["id"] == f"{model}-n"
                and e["node"]["status"] == "healthy"
                for e in seen
            ):
                break
    assert events.headers["content-type"].startswith("text/event-stream")


def test_metrics_as_json(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    fault_daemon.add_node(f"{model}-n", backend.url, model)
    httpx.post(fault_daemon.url + "/v1/chat/completions", json={"model": model, "messages": []}, timeout=30)
    snapshot = fault_daemon.admin.get("/admin/metrics").json()
    assert snapshot["by_model"][model]["requests"] >= 1
    assert snapshot["by_node"][f"{model}-n"]["requests"] >= 1
    assert "ttft_p50_s" not in snapshot["by_node"][f"{model}-n"]  # no stream served yet
    backend.push(Sse(delay_first_event_s=0.2))
    body = {"model": model, "messages": [], "stream": True}
    streamed = httpx.post(fault_daemon.url + "/v1/chat/completions", json=body, timeout=30)
    assert streamed.status_code == 200 and "[DONE]" in streamed.text
    counts = fault_daemon.admin.get("/admin/metrics").json()["by_node"][f"{model}-n"]
    assert 0.2 <= counts["ttft_p50_s"] <= counts["ttft_p95_s"] < 30
    # The plain answer reported usage (5 completion tokens); the scripted stream did not.
    assert counts["completion_tokens"] == 5 and counts["prompt_tokens"] >= 0
    assert counts["failures"] == 0 and counts["attempts"] == counts["requests"]


def test_metrics_count_a_nodes_failed_attempts_and_when_its_last_error_was_seen(
    fault_daemon: Daemon, backends: Backends, model: str
) -> None:
    failing, good = backends(), backends()
    fault_daemon.add_node(f"{model}-bad", failing.url, model)
    fault_daemon.add_node(f"{model}-good", good.url, model)
    failing.push(Status(500))
    bad: dict[str, float] = {}
    for _ in range(40):  # least-connections breaks ties at random: until the failing node was picked
        answer = httpx.post(
            fault_daemon.url + "/v1/chat/completions", json={"model": model, "messages": []}, timeout=30
        )
        assert answer.status_code == 200
        bad = fault_daemon.admin.get("/admin/metrics").json()["by_node"].get(f"{model}-bad", {})
        if bad.get("failures"):
            break
    assert bad["failures"] == bad["retries"] == 1  # the failed attempt went to the other node
    assert bad["attempts"] == bad["requests"] + 1
    view = fault_daemon.admin.get(f"/admin/nodes/{model}-bad").json()
    assert "500" in view["last_error"] and view["last_error_at"] is not None
    assert fault_daemon.admin.get(f"/admin/nodes/{model}-good").json()["last_error_at"] is None
    assert view["slots"] is None  # not a llama.cpp node


def test_the_only_node_of_a_model_keeps_every_failed_attempt_with_its_status_and_text(
    fault_daemon: Daemon, backends: Backends, model: str
) -> None:
    node = backends()
    fault_daemon.add_node(f"{model}-only", node.url, model)
    node.push(Status(500, body=b"boom\x1b[31m"), Status(503), Status(503))
    body = {"model": model, "messages": []}
    # No other node answers: the 5xx count against no breaker, but each one is the node's error.
    statuses = [
        httpx.post(fault_daemon.url + "/v1/chat/completions", json=body, timeout=30).status_code for _ in range(4)
    ]
    assert statuses == [500, 503, 503, 200]
    view = fault_daemon.admin.get(f"/admin/nodes/{model}-only").json()
    assert view["breaker"]["state"] == "closed" and view["last_error_at"] is not None
    assert [(e["status"], e["count"]) for e in view["recent_errors"]] == [(503, 2), (500, 1)]  # newest first
    newest, oldest = view["recent_errors"]
    assert newest["first_at"] <= newest["at"] and "HTTP 503" in newest["error"]
    assert "boom\\x1b[31m" in oldest["error"] and "\x1b" not in oldest["error"]  # the node's text, escaped
    listed = next(n for n in fault_daemon.admin.get("/admin/nodes").json()["nodes"] if n["id"] == f"{model}-only")
    assert listed["recent_errors"] == view["recent_errors"]


def test_openapi_describes_client_and_admin_apis(fault_daemon: Daemon) -> None:
    spec = httpx.get(fault_daemon.url + "/openapi.json", timeout=30).json()
    for path in ("/v1/chat/completions", "/v1/models", "/admin/nodes", "/admin/nodes/{node_id}/drain"):
        assert path in spec["paths"]


def _finished(daemon: Daemon, operation_id: str) -> dict[str, Any]:
    result: dict[str, Any] = {}

    def done() -> bool:
        result.update(daemon.admin.get(f"/admin/operations/{operation_id}").json())
        return bool(result["state"] != "running")

    wait_until(done, 30, f"operation {operation_id}")
    return result


def test_shutting_down_ends_the_event_streams_instead_of_waiting_for_them(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, env={"QIIP_SERVER__SHUTDOWN_TIMEOUT_S": "60"}).start()
    ended: list[str] = []

    def follow() -> None:
        with daemon.admin.stream("GET", "/admin/events", params={"heartbeat_s": 300}, timeout=None) as events:
            ended.append(f"<status {events.status_code}>")
            for line in events.iter_lines():
                ended.append(line)
        ended.append("<end>")

    follower = threading.Thread(target=follow, daemon=True)
    try:
        follower.start()
        wait_until(lambda: "<status 200>" in ended, what="the stream to start")
        # The daemon's grace period is a minute: had it waited for the stream, stop() would kill it at 30 s.
        assert daemon.stop(signal.SIGTERM) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
        follower.join(60)
        assert ended[-1] == "<end>"
        assert "Exception in ASGI application" not in daemon.log()
        assert "Waiting for connections to close" not in daemon.log()
    finally:
        daemon.close()
