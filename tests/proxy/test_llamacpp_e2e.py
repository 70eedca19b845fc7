"""The real daemon in front of real llama-server processes, driven by the real `openai` client."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.daemon import Daemon

pytestmark = pytest.mark.integration


@pytest.fixture
def client(llama_daemon: Daemon) -> Iterator[openai.OpenAI]:
    # Closed after each test: a client left to the garbage collector leaves its pooled socket unclosed.
    with openai.OpenAI(base_url=llama_daemon.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_models_lists_the_union_of_healthy_nodes(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert sorted(m.id for m in models) == ["tiny-chat", "tiny-embed"]
    assert {m.owned_by for m in models} == {"llama_cpp"}
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("org/absent:q4")
    assert info.value.code == "model_not_found"


def test_chat_completion(client: openai.OpenAI) -> None:
    # Greedy: random weights sampled at the default temperature can pick the end-of-generation token early.
    response = client.chat.completions.create(
        model="tiny-chat",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        temperature=0,
    )
    assert response.choices[0].finish_reason == "length"
    assert response.usage is not None and response.usage.completion_tokens == 5


def test_streaming_chat_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny-chat",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        max_tokens=16,
        # Greedy, so the same tokens every run: random weights otherwise pick byte tokens at random, and a
        # run of bytes that is not yet valid UTF-8 streams as no content at all.
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert content_chunks
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


def test_text_completion_stream_and_not(client: openai.OpenAI) -> None:
    done = client.completions.create(model="tiny-chat", prompt="once upon", max_tokens=4)
    assert done.choices[0].finish_reason == "length"
    pieces = list(client.completions.create(model="tiny-chat", prompt="once upon", max_tokens=4, stream=True))
    assert pieces and all(p.object == "text_completion" for p in pieces)


def test_embeddings(client: openai.OpenAI) -> None:
    result = client.embeddings.create(model="tiny-embed", input=["alpha", "beta"])
    assert len(result.data) == 2 and len(result.data[0].embedding) == 64


def test_load_spreads_over_both_nodes(llama_daemon: Daemon, client: openai.OpenAI) -> None:
    before = {n: llama_daemon.counter("qiip_requests_total", node=n) for n in ("chat-a", "chat-b")}
    for _ in range(12):
        client.completions.create(model="tiny-chat", prompt="x", max_tokens=1)
    after = {n: llama_daemon.counter("qiip_requests_total", node=n) for n in ("chat-a", "chat-b")}
    assert all(after[n] > before[n] for n in after)


def test_invalid_requests_get_openai_errors(llama_daemon: Daemon, client: openai.OpenAI) -> None:
    raw = httpx.post(
        llama_daemon.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    no_model = httpx.post(llama_daemon.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    bad_stream = httpx.post(llama_daemon.url + "/v1/completions", json={"model": "tiny-chat", "stream": "yes"})
    assert bad_stream.status_code == 400


def test_upstream_4xx_is_relayed_verbatim(llama_daemon: Daemon) -> None:
    # llama-server rejects a chat request without messages with its own 4xx body.
    response = httpx.post(llama_daemon.url + "/v1/chat/completions", json={"model": "tiny-chat"}, timeout=10)
    assert 400 <= response.status_code < 500
    assert "error" in response.json()
    assert llama_daemon.node_statuses()["chat-a"] == "healthy"


def test_metrics_exposes_requests_and_latency(llama_daemon: Daemon, client: openai.OpenAI) -> None:
    list(
        client.chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True
        )
    )
    text = llama_daemon.metrics()
    for series in (
        "qiip_requests_total",
        "qiip_request_duration_seconds_bucket",
        "qiip_time_to_first_token_seconds_bucket",
        "qiip_in_flight_requests",
        "qiip_node_status",
    ):
        assert series in text


def test_llama_servers_get_none_of_the_daemons_secrets(llama_daemon: Daemon) -> None:
    assert llama_daemon.process is not None
    children = [
        pid
        for pid in os.listdir("/proc")
        if pid.isdigit() and _parent(int(pid)) == llama_daemon.process.pid and b"llama-server" in _read(pid, "cmdline")
    ]
    assert len(children) == 3
    for pid in children:
        environ = dict(item.split(b"=", 1) for item in _read(pid, "environ").split(b"\0") if b"=" in item)
        assert not [name for name in environ if name.startswith(b"QIIP_")]
        assert b"test-password" not in b"".join(environ.values())
        assert b"PATH" in environ  # what it needs is still there


def _read(pid: str, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def _parent(pid: int) -> int:
    stat = _read(str(pid), "stat").decode(errors="replace")
    return int(stat.rsplit(")", 1)[1].split()[1]) if ")" in stat else -1
