"""The fleet journal and the engine logs against a real daemon: a local llama-server node and a scripted one."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.daemon import WAIT_S, Daemon, llama_daemon_with, wait_until
from tests.support.fault_backend import FaultBackend

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path, llama_server_binary: Path) -> Iterator[Daemon]:
    local = [{"id": "chat-a", "gguf": str(tiny_gguf), "model": "tiny-chat", "slots": 1, "threads": 1}]
    with llama_daemon_with(tmp_path_factory.mktemp("journal"), llama_server_binary, local) as daemon:
        yield daemon


def sse(response: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    event = ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            yield event, json.loads(line[6:])


def journal(daemon: Daemon) -> list[dict[str, Any]]:
    with daemon.admin.stream("GET", "/admin/journal", params={"follow": "false"}) as response:
        assert response.status_code == 200
        return [data for event, data in sse(response) if event == "entry"]


def find(entries: list[dict[str, Any]], **wanted: Any) -> dict[str, Any] | None:
    return next((e for e in entries if all(e.get(k) == v for k, v in wanted.items())), None)


def wait_entry(daemon: Daemon, **wanted: Any) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def seen() -> bool:
        entry = find(journal(daemon), **wanted)
        found[:] = [entry] if entry else []
        return bool(found)

    wait_until(seen, what=f"a journal entry {wanted}")
    return found[0]


def test_the_journal_keeps_nodes_arriving_and_turning_healthy(daemon: Daemon) -> None:
    entries = journal(daemon)
    added = find(entries, node="chat-a", event="added")
    assert added is not None and added["at"].endswith("+00:00")
    healthy = find(entries, node="chat-a", event="status", to="healthy")
    assert healthy is not None and healthy["reason"] == "health probe ok"
    assert [e["seq"] for e in entries] == sorted(e["seq"] for e in entries)


def test_a_drain_shows_its_operation_and_the_status_change_with_its_reason(daemon: Daemon) -> None:
    with FaultBackend(model="drain-model") as backend:
        daemon.add_node("ext-drain", backend.url, "drain-model")
        answer = daemon.admin.post("/admin/nodes/ext-drain/drain", json={})
        assert answer.status_code == 202
        operation = answer.json()["id"]
        change = wait_entry(daemon, node="ext-drain", event="status", to="draining")
        assert change["from"] == "healthy"
        assert change["reason"] == f"drain operation {operation}"
        done = wait_entry(daemon, node="ext-drain", event="operation_succeeded")
        assert done["operation"] == operation and "remaining_in_flight=0" in done["reason"]
        assert find(journal(daemon), node="ext-drain", event="operation_started", operation=operation) is not None
        daemon.remove_node("ext-drain")
        wait_entry(daemon, node="ext-drain", event="removed")


def test_a_node_whose_backend_dies_turns_unhealthy_with_the_probe_failure(daemon: Daemon) -> None:
    backend = FaultBackend(model="dying-model")
    try:
        daemon.add_node("ext-dying", backend.url, "dying-model")
    finally:
        backend.close()
    change = wait_entry(daemon, node="ext-dying", event="status", to="unhealthy")
    assert change["from"] == "healthy"
    assert "failed health probe" in change["reason"]
    daemon.remove_node("ext-dying")


def test_the_journal_follows_new_entries_live(daemon: Daemon) -> None:
    seen: list[dict[str, Any]] = []

    def read() -> None:
        with daemon.admin.stream("GET", "/admin/journal", params={"follow": "true"}) as response:
            for _event, data in sse(response):
                seen.append(data)
                if data["node"] == "ext-live" and data["event"] == "added":
                    return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_until(lambda: len(seen) > 0, what="the backlog")
    with FaultBackend(model="live-model") as backend:
        daemon.add_node("ext-live", backend.url, "live-model", wait=False)
        reader.join(60)
        assert find(seen, node="ext-live", event="added") is not None
        daemon.remove_node("ext-live")


def test_the_engine_log_has_llama_server_lines_and_follows_new_ones(daemon: Daemon) -> None:
    with daemon.admin.stream("GET", "/admin/nodes/chat-a/log", params={"lines": 50, "follow": "false"}) as response:
        assert response.status_code == 200
        lines = [data["line"] for event, data in sse(response) if event == "line"]
    assert 0 < len(lines) <= 50
    assert any("server" in line for line in lines), lines[-5:]

    fresh: list[str] = []
    following = threading.Event()

    def read() -> None:
        with daemon.admin.stream("GET", "/admin/nodes/chat-a/log", params={"lines": 0}) as response:
            following.set()
            for _event, data in sse(response):
                fresh.append(data.get("line", ""))
                if any("completion" in line or "slot" in line for line in fresh):
                    return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert following.wait(60)
    # The stream's head can come before the daemon reaches the log's end: ask again until a fresh line arrives.
    body = {"model": "tiny-chat", "prompt": "hello", "max_tokens": 2}
    deadline = time.monotonic() + WAIT_S
    while reader.is_alive() and time.monotonic() < deadline:
        assert daemon.client.post("/v1/completions", json=body).status_code == 200
        reader.join(1)
    assert not reader.is_alive(), fresh
    assert fresh


def test_the_engine_log_is_refused_for_a_node_this_daemon_did_not_launch(daemon: Daemon) -> None:
    with FaultBackend(model="remote-model") as backend:
        daemon.add_node("ext-remote", backend.url, "remote-model")
        answer = daemon.admin.get("/admin/nodes/ext-remote/log", params={"follow": "false"})
        assert answer.status_code == 409
        message = answer.json()["error"]["message"]
        assert "ext-remote" in message and "127.0.0.1" in message and "not kept by this daemon" in message
        daemon.remove_node("ext-remote")
    missing = daemon.admin.get("/admin/nodes/no-such-node/log", params={"follow": "false"})
    assert missing.status_code == 404 and "no-such-node" in missing.json()["error"]["message"]
    too_many = daemon.admin.get("/admin/nodes/chat-a/log", params={"lines": 10_001, "follow": "false"})
    assert too_many.status_code == 422


def test_the_journal_and_engine_logs_need_the_admin_credentials(daemon: Daemon) -> None:
    for path in ("/admin/journal", "/admin/nodes/chat-a/log"):
        answer = daemon.client.get(path, params={"follow": "false"})
        assert answer.status_code == 401, path
