"""SSE relay: byte for byte, whole events, one honest in-band error after the first byte."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support.daemon import Daemon
from tests.support.fault_backend import FaultBackend, Sse, big_line_event
from tests.support.openai_client import openai_client

pytestmark = pytest.mark.integration

Backends = Callable[..., FaultBackend]
CHAT = "/v1/chat/completions"


def stream_body(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}


def chunk(content: str) -> bytes:
    data = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def relay(daemon: Daemon, backend: FaultBackend, model: str, writes: list[bytes]) -> httpx.Response:
    backend.default = Sse(writes=writes)
    daemon.add_node(f"{model}-n", backend.url, model)
    return httpx.post(daemon.url + CHAT, json=stream_body(model), timeout=30)


def test_event_split_across_writes_arrives_intact(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    event = chunk("hello")
    writes = [event[:7], event[7:20], event[20:-1], event[-1:], chunk("world"), b"data: [DONE]\n\n"]
    response = relay(fault_daemon, backends(), model, writes)
    assert response.content == b"".join(writes)


def test_utf8_character_split_across_chunks(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    event = chunk("日本語 👍")
    cut = event.index("👍".encode()) + 2
    writes = [event[:cut], event[cut:], b"data: [DONE]\n\n"]
    response = relay(fault_daemon, backends(), model, writes)
    assert response.content == b"".join(writes)
    assert "👍" in response.text


def test_one_mebibyte_line(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    line = big_line_event(1 << 20)
    writes = [line[i : i + 50_000] for i in range(0, len(line), 50_000)] + [b"data: [DONE]\n\n"]
    response = relay(fault_daemon, backends(), model, writes)
    assert response.content == line + b"data: [DONE]\n\n"


def test_openai_client_reads_a_streamed_answer(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    fault_daemon.add_node(f"{model}-n", backend.url, model)
    client = openai_client(fault_daemon.url + "/v1")
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "tok0 tok1 tok2 tok3 tok4 "
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert (backend.requests[-1].json or {})["stream_options"] == {"include_usage": True}


def test_failure_after_first_byte_ends_with_one_error_event(
    fault_daemon: Daemon, backends: Backends, model: str
) -> None:
    broken, spare = backends(), backends()
    broken.default = Sse(n_events=10, reset_after_events=3)
    fault_daemon.add_node(f"{model}-broken", broken.url, model)
    response = httpx.post(fault_daemon.url + CHAT, json=stream_body(model), timeout=30)
    fault_daemon.add_node(f"{model}-spare", spare.url, model)
    assert response.status_code == 200
    events = [e for e in response.text.split("\n\n") if e]
    assert [e.startswith("data: {") for e in events[:3]] == [True, True, True]
    error = json.loads(events[3].removeprefix("data: "))["error"]
    assert error["code"] == "backend_transport_error" and error["type"] == "upstream_error"
    assert events[4:] == ["data: [DONE]"]
    assert sum(1 for r in broken.requests if r.path == CHAT) == 1
    assert not any(r.path == CHAT for r in spare.requests)


def test_partial_event_is_never_relayed_before_an_error(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    whole, half = chunk("one"), chunk("two")[:15]
    backend.default = Sse(writes=[whole, half], reset_after_events=2)
    fault_daemon.add_node(f"{model}-n", backend.url, model)
    response = httpx.post(fault_daemon.url + CHAT, json=stream_body(model), timeout=30)
    assert response.content.startswith(whole + b'data: {"error"')
    assert response.content.endswith(b"data: [DONE]\n\n")


def test_openai_client_raises_on_the_in_band_error(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    backend.default = Sse(n_events=5, reset_after_events=2)
    fault_daemon.add_node(f"{model}-n", backend.url, model)
    client = openai_client(fault_daemon.url + "/v1")
    received = []
    with pytest.raises(openai.APIError):
        for c in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], stream=True):
            received.append(c)
    assert len(received) == 2


def test_silent_node_mid_stream_times_out_in_band(fault_daemon: Daemon, backends: Backends, model: str) -> None:
    backend = backends()
    backend.default = Sse(n_events=3, delay_between_s=3)
    fault_daemon.add_node(f"{model}-n", backend.url, model)
    response = httpx.post(fault_daemon.url + CHAT, json=stream_body(model), timeout=30)
    assert b'"code": "backend_timeout"' in response.content and response.content.endswith(b"data: [DONE]\n\n")
    backend.wait_for_disconnect()
