"""`X-QIIP-Node`: every answer a node produced names that node, read through the real `openai` client."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import openai
import pytest

from tests.support.daemon import Daemon
from tests.support.failover import busy
from tests.support.fault_backend import FaultBackend, Status

pytestmark = pytest.mark.integration

CHAT_NODES = {"chat-a", "chat-b"}


@pytest.fixture
def client(llama_daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=llama_daemon.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_chat_completions_and_embeddings_name_the_node(client: openai.OpenAI) -> None:
    chat = client.chat.completions.with_raw_response.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hello"}], max_tokens=3
    )
    assert chat.headers["x-qiip-node"] in CHAT_NODES
    assert chat.parse().choices[0].message is not None

    completion = client.completions.with_raw_response.create(model="tiny-chat", prompt="hello", max_tokens=3)
    assert completion.headers["x-qiip-node"] in CHAT_NODES

    embedding = client.embeddings.with_raw_response.create(model="tiny-embed", input=["alpha"])
    assert embedding.headers["x-qiip-node"] == "embed"
    assert len(embedding.parse().data) == 1


def test_a_stream_names_the_node_in_its_headers(client: openai.OpenAI) -> None:
    with client.chat.completions.with_streaming_response.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hello"}], max_tokens=3, stream=True
    ) as response:
        assert response.headers["x-qiip-node"] in CHAT_NODES
        assert response.headers.get_list("x-qiip-node") == [response.headers["x-qiip-node"]]
        assert any(line.startswith("data: ") for line in response.iter_lines())


def test_after_a_failover_the_header_names_the_node_that_answered(
    fault_daemon: Daemon, backends: Callable[..., FaultBackend], model: str
) -> None:
    broken, alive = backends(), backends()
    broken.default = Status(500)
    fault_daemon.add_node(f"{model}-alive", alive.url, model)
    with busy(fault_daemon, alive, model):
        # The alive node is busy, so least-connections tries the broken one first.
        fault_daemon.add_node(f"{model}-broken", broken.url, model)
        with openai.OpenAI(base_url=fault_daemon.url + "/v1", api_key="x", max_retries=0) as client:
            answer = client.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": "hi"}]
            )
    assert broken.requests, "the broken node was tried first"
    assert answer.status_code == 200
    assert answer.headers.get_list("x-qiip-node") == [f"{model}-alive"]


def test_a_node_error_relayed_as_is_names_the_node(
    fault_daemon: Daemon, backends: Callable[..., FaultBackend], model: str
) -> None:
    picky = backends()
    raw = b'{"error": {"message": "no", "type": "invalid_request_error", "code": "x"}}'
    # A node that sets the header itself does not get to speak for the gateway.
    picky.default = Status(400, raw, headers={"x-qiip-node": "forged"})
    fault_daemon.add_node(f"{model}-picky", picky.url, model)
    with openai.OpenAI(base_url=fault_daemon.url + "/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert info.value.response.headers.get_list("x-qiip-node") == [f"{model}-picky"]
