"""Load shedding (`[admission]`) through the real daemon: past a model's bound on requests in flight, the next
request, plain or streamed, gets 429 with `Retry-After` and OpenAI's error JSON (the `openai` library raises
`RateLimitError`), nothing is sent to a node, and once the requests in flight end, requests pass again."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from tests.support.daemon import Daemon, wait_until
from tests.support.fault_backend import Completion, FaultBackend, Gated
from tests.support.openai_client import openai_client

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def shedding(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon admitting 2 requests in flight per model by default, and 1 for `one-at-a-time`."""
    env = {
        "QIIP_ADMISSION__MAX_IN_FLIGHT": "2",
        "QIIP_ADMISSION__RETRY_AFTER_S": "3",
        "QIIP_ADMISSION__MODELS": json.dumps({"one-at-a-time": {"max_in_flight": 1}}),
    }
    with Daemon(tmp_path_factory.mktemp("shedding"), env=env) as daemon:
        yield daemon


def _hold(daemon: Daemon, backend: FaultBackend, model: str, n: int, *, stream: bool = False) -> Callable[[], None]:
    """Put `n` requests for `model` in flight, held by the backend; returns a function that releases them and
    waits for their (successful) answers."""
    gate = threading.Event()
    backend.push(*[Gated(gate, Completion()) for _ in range(n)])
    answers: list[int] = []
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}

    def send() -> None:
        with httpx.Client(timeout=30) as client:
            answers.append(client.post(daemon.url + "/v1/chat/completions", json=body).status_code)

    threads = [threading.Thread(target=send) for _ in range(n)]
    for thread in threads:
        thread.start()
    backend.wait_for_requests(n, 10, path="/v1/chat/completions")

    def release() -> None:
        gate.set()
        for thread in threads:
            thread.join(30)
        assert answers == [200] * n

    return release


def test_past_the_bound_requests_are_shed_with_429_and_pass_again_once_the_load_ends(
    shedding: Daemon, backends: Callable[..., FaultBackend], model: str
) -> None:
    backend = backends()
    shedding.add_node(f"{model}-n", backend.url, model)
    release = _hold(shedding, backend, model, 2, stream=True)
    client = openai_client(shedding.url + "/v1")
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    try:
        with pytest.raises(openai.RateLimitError) as plain:
            client.chat.completions.create(model=model, messages=messages)
        with pytest.raises(openai.RateLimitError) as streamed:
            client.chat.completions.create(model=model, messages=messages, stream=True)
    finally:
        release()
    for refused in (plain.value, streamed.value):
        assert refused.status_code == 429 and refused.code == "model_overloaded"
        assert refused.type == "rate_limit_error"
        assert refused.response.headers["Retry-After"] == "3"
        assert "2 requests are in flight" in refused.message and "admission.max_in_flight" in refused.message
    # The shed requests never reached the node.
    assert len([r for r in backend.requests if r.path == "/v1/chat/completions"]) == 2
    wait_until(lambda: shedding.in_flight(f"{model}-n") == 0, what="the held requests to end")
    answer = client.chat.completions.create(model=model, messages=messages)
    assert answer.choices[0].message.content
    assert shedding.counter("qiip_requests_shed_total", model=model, reason="max_in_flight") == 2
    assert shedding.counter("qiip_requests_total", model=model, status="429") == 2
    assert shedding.in_flight(f"{model}-n") == 0


def test_a_models_own_bound_beats_the_default(shedding: Daemon, backends: Callable[..., FaultBackend]) -> None:
    backend = backends()
    shedding.add_node("one-at-a-time-n", backend.url, "one-at-a-time")
    release = _hold(shedding, backend, "one-at-a-time", 1)
    try:
        body = {"model": "one-at-a-time", "messages": []}
        refused = httpx.post(shedding.url + "/v1/chat/completions", json=body, timeout=30)
    finally:
        release()
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "3"
    assert refused.json()["error"]["code"] == "model_overloaded"
    assert "(1: admission.max_in_flight)" in refused.json()["error"]["message"]
    wait_until(lambda: shedding.in_flight("one-at-a-time-n") == 0, what="the held request to end")
    assert httpx.post(shedding.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
