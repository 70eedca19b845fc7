"""Prefix-aware routing through the real daemon in front of real llama-server nodes: a conversation keeps its
node, whose prompt cache then holds its prefix (llama-server's `usage.prompt_tokens_details.cached_tokens`);
a node busy beyond the imbalance bound, or drained, yields to the other; a model routed by least-connections
has no affinity.

Nodes are kept busy by streams the test holds open: a generated model with a wider embedding generates slowly
enough (several milliseconds a token) that a stream asked for thousands of tokens is still running when the
test's next request arrives, and it is closed as soon as it is not needed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qiip_core.engines.llamacpp import make_test_gguf
from tests.support.daemon import Daemon, llama_daemon_with, wait_until

pytestmark = pytest.mark.integration

STICKY, PLAIN = "sticky-chat", "plain-chat"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, llama_server_binary: Path) -> Iterator[Daemon]:
    """Two nodes of a prefix-affinity model and two of a least-connections one; the affinity node may have one
    request in flight more than the least-loaded node."""
    gguf = make_test_gguf(
        tmp_path_factory.mktemp("gguf") / "wide.gguf", n_layers=2, n_embd=256, n_ff=1024, n_ctx_train=4096
    )[0]
    local = [
        {"id": node_id, "gguf": str(gguf), "model": model, "slots": 2, "threads": 1}
        for node_id, model in (("pa-1", STICKY), ("pa-2", STICKY), ("lc-1", PLAIN), ("lc-2", PLAIN))
    ]
    env = {
        "QIIP_ROUTING__POLICY": "prefix_affinity",
        "QIIP_ROUTING__MODEL_POLICY": json.dumps({PLAIN: "least_connections"}),
        "QIIP_ROUTING__PREFIX_IMBALANCE_REQUESTS": "1",
        "QIIP_ROUTING__PREFIX_IMBALANCE_RATIO": "0",
    }
    with llama_daemon_with(tmp_path_factory.mktemp("prefix-daemon"), llama_server_binary, local, env=env) as daemon:
        yield daemon


class Conversation:
    """A multi-turn chat: each turn resends the whole history, with the node's answer appended."""

    def __init__(self, daemon: Daemon, model: str, topic: str) -> None:
        self.daemon, self.model = daemon, model
        words = " ".join(f"{topic}{i % 17}" for i in range(120))
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": f"Notes on {topic}: {words}"}]

    def body(self, question: str, **extra: Any) -> dict[str, Any]:
        messages = [*self.messages, {"role": "user", "content": question}]
        return {"model": self.model, "messages": messages, "temperature": 0, **extra}

    def turn(self, question: str) -> tuple[str, dict[str, Any]]:
        """Ask, append the question and the answer to the history; returns the node and the answer's usage."""
        response = self.daemon.client.post("/v1/chat/completions", json=self.body(question, max_tokens=4))
        assert response.status_code == 200, response.text
        answer = response.json()
        self.messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
        ]
        return response.headers["x-qiip-node"], answer["usage"]


@contextlib.contextmanager
def held_stream(daemon: Daemon, body: dict[str, Any]) -> Iterator[str]:
    """A stream of thousands of tokens, held open from its first event until the block ends; yields its node."""
    with (
        httpx.Client(base_url=daemon.url, trust_env=False, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 3500, "stream": True}) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        yield stream.headers["x-qiip-node"]


def affinity_count(daemon: Daemon, model: str, result: str) -> float:
    return daemon.counter("qiip_prefix_affinity_total", model=model, result=result)


def idle(daemon: Daemon, *nodes: str) -> None:
    wait_until(lambda: all(daemon.in_flight(n) == 0 for n in nodes), what=f"{nodes} to have nothing in flight")


def test_a_conversation_keeps_its_node_whose_cache_holds_its_prefix(daemon: Daemon) -> None:
    hits = affinity_count(daemon, STICKY, "hit")
    chat = Conversation(daemon, STICKY, "rivers")
    first, usage = chat.turn("What is the longest river?")
    previous_prompt = usage["prompt_tokens"]
    for turn in range(2, 6):
        node, usage = chat.turn(f"And the {turn}th longest?")
        assert node == first
        # The node's prompt cache held the whole previous prompt (its answer may re-tokenise differently).
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * previous_prompt
        previous_prompt = usage["prompt_tokens"]
    assert affinity_count(daemon, STICKY, "hit") - hits == 4


def test_a_node_busy_beyond_the_imbalance_bound_yields(daemon: Daemon) -> None:
    chat = Conversation(daemon, STICKY, "mountains")
    first, _ = chat.turn("Which mountain is the highest?")
    other = "pa-2" if first == "pa-1" else "pa-1"
    overloaded = affinity_count(daemon, STICKY, "overloaded")
    # Requests sharing the conversation's prefix go to its node while it has at most one more in flight.
    with held_stream(daemon, chat.body("Tell me more.")) as one, held_stream(daemon, chat.body("Much more.")) as two:
        assert one == two == first
        node, usage = chat.turn("And the second highest?")
        assert node == other and usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"] / 2
    assert affinity_count(daemon, STICKY, "overloaded") - overloaded == 1
    idle(daemon, first, other)
    # The prefix moved with the request: the conversation now stays on the other node.
    node, usage = chat.turn("And the third?")
    assert node == other and usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_draining_the_affinity_node_falls_back(daemon: Daemon) -> None:
    chat = Conversation(daemon, STICKY, "deserts")
    first, _ = chat.turn("Which desert is the largest?")
    other = "pa-2" if first == "pa-1" else "pa-1"
    assert daemon.admin.post(f"/admin/nodes/{first}/drain", json={"timeout_s": 5}).status_code == 202
    daemon.wait_status(first, "draining")
    try:
        node, _ = chat.turn("And the second largest?")
        assert node == other
    finally:
        assert daemon.admin.post(f"/admin/nodes/{first}/undrain", json={}).status_code == 200
        daemon.wait_status(first, "healthy")
    node, _ = chat.turn("And the third?")
    assert node == other


def test_a_least_connections_model_has_no_affinity(daemon: Daemon) -> None:
    chat = Conversation(daemon, PLAIN, "oceans")
    first, _ = chat.turn("Which ocean is the deepest?")
    other = "lc-2" if first == "lc-1" else "lc-1"
    idle(daemon, first, other)
    # Make the conversation's node busier than the other by one request, which prefix affinity would accept.
    with contextlib.ExitStack() as on_first, contextlib.ExitStack() as on_other:
        held = on_first.enter_context(held_stream(daemon, Conversation(daemon, PLAIN, "lakes").body("Lakes?")))
        if held != first:
            on_other.callback(on_first.pop_all().close)
            seas = Conversation(daemon, PLAIN, "seas").body("Seas?")
            assert on_first.enter_context(held_stream(daemon, seas)) == first
            on_other.close()
            idle(daemon, other)
        node, usage = chat.turn("And the second deepest?")
        assert node == other and usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"] / 2
    assert affinity_count(daemon, PLAIN, "hit") + affinity_count(daemon, PLAIN, "miss") == 0
