"""`GET /metrics` of the real daemon: time to first token, tokens, failovers and upstream errors by kind, checked
by Prometheus' own `promtool`; and the tokens a real llama-server reports, counted from its streams too."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.daemon import Daemon, llama_daemon_with, wait_until
from tests.support.fault_backend import Completion, FaultBackend, Sse, Status
from tests.support.fault_backend._payloads import chat_chunk, sse_event

pytestmark = pytest.mark.integration

Backends = Callable[..., FaultBackend]
CHAT = "/v1/chat/completions"


def chat(daemon: Daemon, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "three word prompt"}], **extra}
    return httpx.post(daemon.url + CHAT, json=body, timeout=30)


def test_metrics_pass_promtool_after_streams_answers_and_failures(
    fault_daemon: Daemon, backends: Backends, model: str
) -> None:
    broken, dead, alive = backends(), backends(), backends()
    broken.default = Status(503)
    for name, backend in (("broken", broken), ("dead", dead), ("alive", alive)):
        fault_daemon.add_node(f"{model}-{name}", backend.url, model)
    dead.stop_listening()
    stream = chat(fault_daemon, model, stream=True, stream_options={"include_usage": True})
    assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n")
    assert chat(fault_daemon, model).status_code == 200
    # Whichever order the nodes were tried in, both answers came from the one node that works.
    labels = {"model": model, "node": f"{model}-alive"}
    assert fault_daemon.counter("qiip_requests_total", status="200", **labels) == 2
    # Completion() counts the prompt's words: 3 prompt tokens and 5 completion tokens per answer.
    assert fault_daemon.counter("qiip_prompt_tokens_total", **labels) == 6
    assert fault_daemon.counter("qiip_completion_tokens_total", **labels) == 10
    assert fault_daemon.counter("qiip_time_to_first_token_seconds_count", **labels) == 1

    # A failure the client sees: every node fails.
    alive.default = Status(502)
    failed = chat(fault_daemon, model)
    assert failed.status_code in (502, 503) and failed.json()["error"]["code"] == "failover_exhausted"
    assert fault_daemon.counter("qiip_upstream_errors_total", model=model, kind="connect") >= 1
    assert fault_daemon.counter("qiip_upstream_errors_total", model=model, kind="status") >= 2
    # Every attempt but each request's first went to another node: 2 answers, the failed attempts, 3 requests.
    failed_attempts = fault_daemon.counter("qiip_upstream_errors_total", model=model)
    assert fault_daemon.counter("qiip_failover_attempts_total", model=model) == failed_attempts + 2 - 3

    exposition = fault_daemon.client.get("/metrics").text
    assert "qiip_upstream_errors_total{" in exposition and "qiip_failover_attempts_total{" in exposition
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: install the Debian package `prometheus` (scripts/setup --test).")
    checked = subprocess.run([promtool, "check", "metrics"], input=exposition.encode(), capture_output=True, timeout=60)
    assert checked.returncode == 0, (checked.stdout + checked.stderr).decode()


def test_time_to_first_token_waits_for_the_first_data_event(
    fault_daemon: Daemon, backends: Backends, model: str
) -> None:
    backend = backends()
    node = f"{model}-n"
    fault_daemon.add_node(node, backend.url, model)
    event = sse_event(chat_chunk("chatcmpl-1", model, 0, content="tok"))
    # A comment (a keep-alive) at once, the first token 0.3 s later.
    backend.push(Sse(writes=[b": keep-alive\n\n", event, b"data: [DONE]\n\n"], delay_between_s=0.3))
    response = chat(fault_daemon, model, stream=True)
    # The comment came before the commit: dropped, the answer starts with the first token.
    assert response.status_code == 200 and response.text.startswith("data: ")
    labels = {"model": model, "node": node}
    assert fault_daemon.counter("qiip_time_to_first_token_seconds_count", **labels) == 1
    assert fault_daemon.counter("qiip_time_to_first_token_seconds_bucket", le="0.2", **labels) == 0


def test_a_cut_stream_and_a_slow_node_count_by_kind(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    node = f"{model}-n"
    fault_daemon.add_node(node, backend.url, model)
    backend.push(Sse(n_events=5, reset_after_events=2))
    cut = chat(fault_daemon, model, stream=True, stream_options={"include_usage": True})
    assert cut.status_code == 200 and '"code": "backend_transport_error"' in cut.text
    # The fault daemon waits 1 s for a first byte.
    backend.push(Sse(delay_headers_s=1.5))
    assert chat(fault_daemon, model, stream=True).status_code == 504
    backend.push(Sse(close_after_headers=True))
    assert chat(fault_daemon, model, stream=True).status_code == 502
    labels = {"model": model, "node": node}
    for kind in ("truncated", "timeout", "transport"):
        assert fault_daemon.counter("qiip_upstream_errors_total", kind=kind, **labels) == 1, kind
    assert fault_daemon.counter("qiip_upstream_errors_total", **labels) == 3
    # A cut stream reports no usage, and one node alone is never failed over.
    assert fault_daemon.counter("qiip_prompt_tokens_total", **labels) == 0
    assert fault_daemon.counter("qiip_failover_attempts_total", **labels) == 0


def test_a_body_cut_after_its_headers_is_truncated(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    node = f"{model}-n"
    fault_daemon.add_node(node, backend.url, model)
    # Over `upstream.buffer_response_bytes` (1 MiB): relayed as it comes, so the cut comes after the headers.
    piece = b" " * 600_000
    headers = {"content-type": "application/json"}
    backend.push(Sse(writes=[piece, piece, piece], reset_after_events=2, delay_between_s=0.2, headers=headers))
    with pytest.raises(httpx.HTTPError):
        chat(fault_daemon, model)
    wait_until(lambda: fault_daemon.in_flight(node) == 0, what="the reservation to be released")
    assert fault_daemon.counter("qiip_upstream_errors_total", model=model, node=node, kind="truncated") == 1


def test_a_stream_without_usage_counts_no_tokens(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    backend.default = Completion(n_tokens=4)
    node = f"{model}-n"
    fault_daemon.add_node(node, backend.url, model)
    assert chat(fault_daemon, model, stream=True).status_code == 200
    labels = {"model": model, "node": node}
    assert fault_daemon.counter("qiip_requests_total", **labels) == 1
    assert tokens(fault_daemon, node) == (0, 0)
    assert chat(fault_daemon, model, stream=True, stream_options={"include_usage": True}).status_code == 200
    assert tokens(fault_daemon, node) == (3, 4)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path, llama_server_binary: Path) -> Iterator[Daemon]:
    """The tiny model as one chat node and one embeddings node."""
    local = [
        {"id": "chat", "gguf": str(tiny_gguf), "model": "tiny-chat", "slots": 1, "threads": 1},
        {"id": "embed", "gguf": str(tiny_gguf), "model": "tiny-embed", "slots": 1, "embeddings": True, "threads": 1},
    ]
    with llama_daemon_with(tmp_path_factory.mktemp("llama-metrics"), llama_server_binary, local) as daemon:
        yield daemon


def tokens(daemon: Daemon, node: str) -> tuple[float, float]:
    return (
        daemon.counter("qiip_prompt_tokens_total", node=node),
        daemon.counter("qiip_completion_tokens_total", node=node),
    )


def test_llama_server_usage_is_counted_from_answers_and_streams(llama: Daemon) -> None:
    with openai.OpenAI(base_url=llama.url + "/v1", api_key="unused", max_retries=0) as client:
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
        answer = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=3)
        assert answer.usage is not None
        counted = (answer.usage.prompt_tokens, answer.usage.completion_tokens)
        assert tokens(llama, "chat") == counted

        # A chat stream carries usage when the client asks for it, in a last chunk without choices.
        chunks = list(
            client.chat.completions.create(
                model="tiny-chat",
                messages=messages,
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        usage = chunks[-1].usage
        assert usage is not None and not chunks[-1].choices
        counted = (counted[0] + usage.prompt_tokens, counted[1] + usage.completion_tokens)
        assert tokens(llama, "chat") == counted

        # llama-server sends none on a chat stream not asking for it, and always on a completions stream.
        list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=2, stream=True))
        assert tokens(llama, "chat") == counted
        pieces = list(client.completions.create(model="tiny-chat", prompt="once upon", max_tokens=2, stream=True))
        usage = pieces[-1].usage
        assert usage is not None
        counted = (counted[0] + usage.prompt_tokens, counted[1] + usage.completion_tokens)
        assert tokens(llama, "chat") == counted
        assert llama.counter("qiip_time_to_first_token_seconds_count", node="chat") == 3

        embedded = client.embeddings.create(model="tiny-embed", input=["alpha beta", "gamma"])
        assert embedded.usage.prompt_tokens > 0
        assert tokens(llama, "embed") == (embedded.usage.prompt_tokens, 0)
