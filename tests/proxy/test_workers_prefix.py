"""Prefix affinity over two serving processes (`server.workers = 2`), in front of real llama-server nodes: a
conversation whose turns arrive on connections served by different processes keeps its node, whose prompt cache
holds its prefix (llama-server's `usage.prompt_tokens_details.cached_tokens`): the prefixes one process routes
reach the other through the primary."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qiip_core.engines.llamacpp import make_test_gguf
from tests.support.daemon import Daemon, wait_until
from tests.support.workers import Connections, answer, ask, start_with_workers

pytestmark = pytest.mark.integration

MODEL = "shared-prefix-chat"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, llama_server_binary: Path) -> Iterator[Daemon]:
    gguf = make_test_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", n_layers=2, n_embd=128, n_ctx_train=4096)[0]
    nodes = ("sp-1", "sp-2")
    local = [{"id": node_id, "gguf": str(gguf), "model": MODEL, "slots": 2, "threads": 1} for node_id in nodes]
    env = {
        "QIIP_SERVER__WORKERS": "2",
        "QIIP_LOCAL_NODES": json.dumps(local),
        "QIIP_ENGINES__LLAMACPP__SERVER_BINARY": str(llama_server_binary),
        "QIIP_ROUTING__POLICY": "prefix_affinity",
    }
    daemon = Daemon(tmp_path_factory.mktemp("workers-prefix"), env=env)
    try:
        start_with_workers(daemon)
        for node_id in nodes:
            daemon.wait_status(node_id, "healthy", timeout_s=120)
        yield daemon
    finally:
        daemon.close()


def turn(connections: Connections, pid: int, messages: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """One turn of a conversation sent on a connection `pid` serves; appends the answer to `messages`."""
    connection = connections.on(pid)
    ask(connection, MODEL, messages=messages, temperature=0, max_tokens=4)
    status, headers, body = answer(connection)
    assert status == 200, body
    reply = json.loads(body)
    messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    return headers["x-qiip-node"], reply["usage"]


def test_a_conversation_keeps_its_node_whichever_process_serves_each_turn(daemon: Daemon) -> None:
    connections = Connections(daemon)
    try:
        primary, worker = connections.pids
        hits = daemon.counter("qiip_prefix_affinity_total", model=MODEL, result="hit")
        for n, order in enumerate([(worker, primary, worker), (primary, worker, primary)] * 2):
            words = " ".join(f"topic{n}-{i % 13}" for i in range(150))
            messages: list[dict[str, Any]] = [{"role": "system", "content": f"Notes: {words}"}]
            messages.append({"role": "user", "content": "Begin."})
            first, usage = turn(connections, order[0], messages)
            for number, pid in enumerate(order[1:], start=2):
                previous_prompt = usage["prompt_tokens"]
                time.sleep(0.4)  # the prefixes reach the other process within 0.2 s
                messages.append({"role": "user", "content": f"Turn {number}."})
                node, usage = turn(connections, pid, messages)
                assert node == first, (n, number)
                assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * previous_prompt
    finally:
        connections.close()
    # Every later turn was a hit, counted by whichever process routed it (a worker's counts reach the primary).
    wait_until(
        lambda: daemon.counter("qiip_prefix_affinity_total", model=MODEL, result="hit") - hits >= 8,
        what="the hits to be counted",
    )
    assert daemon.counter("qiip_prefix_affinity_total", model=MODEL, result="hit") - hits == 8


def test_a_worker_started_again_begins_with_the_prefixes_already_routed(daemon: Daemon) -> None:
    connections = Connections(daemon)
    try:
        primary, worker = connections.pids
        words = " ".join(f"restart-{i % 11}" for i in range(150))
        messages: list[dict[str, Any]] = [{"role": "system", "content": f"Notes: {words}"}]
        messages.append({"role": "user", "content": "Begin."})
        first, usage = turn(connections, primary, messages)
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: daemon.log().count("worker 1 serving") >= 2, what="the worker to be started again")
    finally:
        connections.close()
    renewed = Connections(daemon)
    try:
        hits = daemon.counter("qiip_prefix_affinity_total", model=MODEL, result="hit")
        messages.append({"role": "user", "content": "Turn 2."})
        node, later = turn(renewed, renewed.pids[1], messages)
        assert node == first
        assert later["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"]
        wait_until(
            lambda: daemon.counter("qiip_prefix_affinity_total", model=MODEL, result="hit") - hits >= 1,
            what="the hit to be counted",
        )
        assert daemon.counter("qiip_prefix_affinity_total", model=MODEL, result="hit") - hits == 1
    finally:
        renewed.close()
