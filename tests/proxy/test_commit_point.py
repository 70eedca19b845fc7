"""What commits an answer, and what ends one: the first `data:` event of a stream, never a comment; a stream
is whole only when it ends with `data: [DONE]`, and a plain answer only when it is whole JSON, however the
transport ended them."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support.daemon import Daemon
from tests.support.failover import CHAT, body, busy, calls
from tests.support.fault_backend import FaultBackend, Sse, UnframedJson
from tests.support.fault_backend._payloads import chat_chunk, sse_event
from tests.support.openai_client import openai_client

pytestmark = pytest.mark.integration

Backends = Callable[..., FaultBackend]

PING = b":\n\n"
"""llama-server's keep-alive (`--sse-ping-interval`): a comment line and a blank line."""


def events_of(response: httpx.Response) -> list[str]:
    return [event for event in response.text.split("\n\n") if event]


def test_a_node_killed_while_it_only_sent_comments_is_failed_over(
    fault_daemon: Daemon, backends: Backends, model: str
) -> None:
    killed, fine = backends(), backends()
    killed.default = Sse(writes=[PING, b": PROCESSING\n\n"], reset_after_events=2)
    fault_daemon.add_node(f"{model}-fine", fine.url, model)
    with busy(fault_daemon, fine, model):
        fault_daemon.add_node(f"{model}-killed", killed.url, model)
        response = httpx.post(fault_daemon.url + CHAT, json=body(model, stream=True), timeout=30)
    assert response.status_code == 200 and calls(killed) == 1
    events = events_of(response)
    assert events[-1] == "data: [DONE]" and not any('"error"' in event for event in events)
    assert all(event.startswith("data: ") for event in events)  # the comments were not relayed


def test_comments_do_not_count_as_the_first_token(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    # Pings every 0.3 s and the first token after 3 s: the 1 s first-token limit fires all the same.
    pinging = backends()
    pinging.default = Sse(
        writes=[PING] * 10 + [sse_event(chat_chunk("c", model, 0, content="late"))], delay_between_s=0.3
    )
    fault_daemon.add_node(f"{model}-n", pinging.url, model)
    response = httpx.post(fault_daemon.url + CHAT, json=body(model, stream=True), timeout=30)
    assert response.status_code == 504 and response.json()["error"]["code"] == "backend_timeout"
    assert "first token" in response.json()["error"]["message"]


def test_comments_after_the_first_token_are_relayed(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    first, second = (sse_event(chat_chunk("c", model, 0, content=c)) for c in ("a", "b"))
    backend.default = Sse(writes=[PING, first, PING, second, b"data: [DONE]\n\n"])
    fault_daemon.add_node(f"{model}-n", backend.url, model)
    response = httpx.post(fault_daemon.url + CHAT, json=body(model, stream=True), timeout=30)
    assert response.content == first + PING + second + b"data: [DONE]\n\n"


CUTS = {
    "fin": Sse(n_events=2, done=False, chunked=False),
    "last-chunk": Sse(n_events=2, done=False, chunked=True),
    "rst": Sse(n_events=5, reset_after_events=2, chunked=False),
    "rst-chunked": Sse(n_events=5, reset_after_events=2, chunked=True),
}


@pytest.mark.parametrize("cut", CUTS.values(), ids=CUTS.keys())
def test_a_stream_cut_before_done_ends_with_an_error_whatever_the_framing(
    fault_daemon: Daemon, backends: Backends, model: str, cut: Sse
) -> None:
    backend = backends()
    backend.default = cut
    node = f"{model}-n"
    fault_daemon.add_node(node, backend.url, model)
    response = httpx.post(fault_daemon.url + CHAT, json=body(model, stream=True), timeout=30)
    assert response.status_code == 200
    events = events_of(response)
    assert len(events) == 4 and all(event.startswith("data: {") for event in events[:2])
    error = json.loads(events[2].removeprefix("data: "))["error"]
    assert error["type"] == "upstream_error" and error["code"] == "backend_transport_error"
    assert events[3] == "data: [DONE]"
    # A failure of the node, never a success.
    assert fault_daemon.counter("qiip_upstream_errors_total", node=node, kind="truncated") == 1
    assert fault_daemon.counter("qiip_request_errors_total", node=node, code="backend_transport_error") == 1


def test_the_openai_client_raises_on_a_stream_that_just_stops(
    fault_daemon: Daemon, backends: Backends, model: str
) -> None:
    backend = backends()
    backend.default = CUTS["fin"]
    fault_daemon.add_node(f"{model}-n", backend.url, model)
    client = openai_client(fault_daemon.url + "/v1")
    received = []
    with pytest.raises(openai.APIError, match="incomplete"):
        for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], stream=True
        ):
            received.append(chunk)
    assert len(received) == 2


def test_done_without_its_blank_line_ends_a_stream_cleanly(
    fault_daemon: Daemon, backends: Backends, model: str
) -> None:
    backend = backends()
    event = sse_event(chat_chunk("c", model, 0, content="a"))
    backend.default = Sse(writes=[event, b"data: [DONE]"], done=False, chunked=False)
    fault_daemon.add_node(f"{model}-n", backend.url, model)
    response = httpx.post(fault_daemon.url + CHAT, json=body(model, stream=True), timeout=30)
    assert response.content == event + b"data: [DONE]\n\n"


ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [], "model": "m"}

BROKEN_ANSWERS = {
    "rst": UnframedJson(ANSWER, cut_after_bytes=20, reset=True),
    "fin": UnframedJson(ANSWER, cut_after_bytes=20),
    "last-chunk": UnframedJson(ANSWER, cut_after_bytes=20, chunked=True),
}


@pytest.mark.parametrize("broken_answer", BROKEN_ANSWERS.values(), ids=BROKEN_ANSWERS.keys())
def test_a_plain_answer_cut_short_is_failed_over(
    fault_daemon: Daemon, backends: Backends, model: str, broken_answer: UnframedJson
) -> None:
    broken, fine = backends(), backends()
    broken.default = broken_answer
    fault_daemon.add_node(f"{model}-fine", fine.url, model)
    with busy(fault_daemon, fine, model):
        fault_daemon.add_node(f"{model}-broken", broken.url, model)
        response = httpx.post(fault_daemon.url + CHAT, json=body(model), timeout=30)
    assert response.status_code == 200 and response.json()["object"] == "chat.completion"
    assert calls(broken) == 1 and response.json()["id"] != ANSWER["id"]


@pytest.mark.parametrize("chunked", [False, True], ids=["close-delimited", "chunked"])
def test_a_whole_plain_answer_without_a_length_is_relayed(
    fault_daemon: Daemon, backends: Backends, model: str, chunked: bool
) -> None:
    backend = backends()
    backend.default = UnframedJson(ANSWER, chunked=chunked)
    fault_daemon.add_node(f"{model}-n", backend.url, model)
    response = httpx.post(fault_daemon.url + CHAT, json=body(model), timeout=30)
    assert response.status_code == 200 and response.json() == ANSWER
