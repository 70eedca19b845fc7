"""The fault backend, observed from a real httpx client: each behaviour, the request parser and the records."""

from __future__ import annotations

import base64
import gzip
import importlib
import inspect
import json
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import tests.support.fault_backend as fault_backend
from tests.support.daemon import wait_until
from tests.support.fault_backend import (
    Completion,
    Embeddings,
    FaultBackend,
    Hang,
    Json,
    LoadingThenOk,
    Sse,
    Status,
    Trickle,
    big_line_event,
)

CHAT = "/v1/chat/completions"


@pytest.fixture
def backend() -> Iterator[FaultBackend]:
    with FaultBackend(model="m") as backend:
        yield backend


@pytest.fixture
def client(backend: FaultBackend) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=backend.url, timeout=30.0) as client:
        yield client


def sse_payloads(body: bytes) -> list[Any]:
    """The `data:` payloads of an event stream, JSON-decoded except for `[DONE]`."""
    payloads: list[Any] = []
    for event in body.decode().split("\n\n"):
        if event.startswith("data: "):
            data = event.removeprefix("data: ")
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


def raw_request(port: int, data: bytes, *, then_eof: bool = False) -> bytes:
    """Send raw bytes (then shut down the sending side when `then_eof`); read until the backend closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        if then_eof:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


# -- Routing and plain answers ---------------------------------------------------------------------------


def test_health_and_models(backend: FaultBackend, client: httpx.Client) -> None:
    assert backend.url == f"http://127.0.0.1:{backend.port}"
    health = client.get("/health")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert client.get("/v1/models").json() == {
        "object": "list",
        "data": [{"id": "m", "object": "model", "owned_by": "fault"}],
    }
    assert client.get("/nowhere").status_code == 404
    assert client.get(CHAT).status_code == 405


def test_default_chat_completion_has_usage(backend: FaultBackend, client: httpx.Client) -> None:
    body = client.post(CHAT, json={"model": "m", "messages": [{"role": "user", "content": "two words"}]}).json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "m"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "tok0 tok1 tok2 tok3 tok4 "}
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}


def test_default_text_completion(client: httpx.Client) -> None:
    body = client.post("/v1/completions", json={"model": "m", "prompt": "a b c"}).json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "tok0 tok1 tok2 tok3 tok4 "
    assert body["usage"]["prompt_tokens"] == 3


def test_streamed_completion_ends_with_a_usage_chunk(client: httpx.Client) -> None:
    request = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
    response = client.post(CHAT, json=request)
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["transfer-encoding"] == "chunked"
    *chunks, usage, done = sse_payloads(response.content)
    assert done == "[DONE]"
    assert "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks) == "tok0 tok1 tok2 tok3 tok4 "
    assert all(chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None for chunk in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


def test_streamed_text_completion_without_usage(backend: FaultBackend, client: httpx.Client) -> None:
    backend.push(Completion(n_tokens=2))
    payloads = sse_payloads(client.post("/v1/completions", json={"prompt": "x", "stream": True}).content)
    assert [p["choices"][0]["text"] for p in payloads[:-1]] == ["tok0 ", "tok1 "]
    assert payloads[0]["object"] == "text_completion" and "usage" not in payloads[0]


def test_embeddings_floats_and_base64(backend: FaultBackend, client: httpx.Client) -> None:
    body = client.post("/v1/embeddings", json={"model": "m", "input": ["a", "b c"]}).json()
    assert [item["index"] for item in body["data"]] == [0, 1]
    vector = body["data"][0]["embedding"]
    assert len(vector) == 8 and abs(sum(x * x for x in vector) - 1.0) < 1e-9
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}

    backend.push(Embeddings(dim=4))
    encoded = client.post("/v1/embeddings", json={"input": "a", "encoding_format": "base64"}).json()
    assert len(struct.unpack("<4f", base64.b64decode(encoded["data"][0]["embedding"]))) == 4
    assert client.post("/v1/embeddings", json={}).status_code == 400


def test_json_with_headers_delay_and_gzip(backend: FaultBackend, client: httpx.Client) -> None:
    backend.push(Json(201, {"a": 1}, headers={"X-Test": "yes"}, delay_s=0.05, gzip=True))
    with client.stream("POST", CHAT, json={}) as response:
        wire = b"".join(response.iter_raw())
    assert response.status_code == 201
    assert response.headers["x-test"] == "yes"
    assert response.headers["content-encoding"] == "gzip"
    assert int(response.headers["content-length"]) == len(wire)
    assert json.loads(gzip.decompress(wire)) == {"a": 1}


def test_queue_then_default_and_status(backend: FaultBackend, client: httpx.Client) -> None:
    backend.push(Status(429, headers={"Retry-After": "7"}), Status(500, body=b"oops"))
    throttled = client.post(CHAT, json={})
    assert (throttled.status_code, throttled.headers["retry-after"]) == (429, "7")
    assert throttled.json()["error"]["code"] == 429
    failed = client.post(CHAT, json={})
    assert (failed.status_code, failed.text, failed.headers["content-type"]) == (
        500,
        "oops",
        "text/plain; charset=utf-8",
    )
    assert client.post(CHAT, json={}).status_code == 200
    backend.default = Status(503)
    assert client.post(CHAT, json={}).status_code == 503


# -- Streams and faults ----------------------------------------------------------------------------------


def test_sse_default_events(backend: FaultBackend, client: httpx.Client) -> None:
    backend.push(Sse())
    *chunks, done = sse_payloads(client.post(CHAT, json={}).content)
    assert done == "[DONE]"
    assert [chunk["choices"][0]["delta"]["content"] for chunk in chunks] == [f"tok{i} " for i in range(5)]
    assert len({chunk["id"] for chunk in chunks}) == 1


def test_sse_events_and_no_done(backend: FaultBackend, client: httpx.Client) -> None:
    backend.push(Sse(n_events=3, done=False))
    payloads = sse_payloads(client.post(CHAT, json={}).content)
    assert [p["choices"][0]["delta"]["content"] for p in payloads] == ["tok0 ", "tok1 ", "tok2 "]
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"

    backend.push(Sse(events=[b"data: 1\n\n", b"data: 2\n\n"]))
    assert client.post(CHAT, json={}).content == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"


def test_split_writes_arrive_as_separate_chunks(backend: FaultBackend, client: httpx.Client) -> None:
    euro = "€".encode()  # three bytes, split across two writes
    writes = [b'data: {"c":"' + euro[:1], euro[1:] + b'"}\n', b"\n"]
    backend.push(Sse(writes=writes))
    with client.stream("POST", CHAT, json={}) as response:
        assert list(response.iter_raw()) == writes


def test_unchunked_stream_ends_with_the_connection(backend: FaultBackend, client: httpx.Client) -> None:
    backend.push(Sse(writes=[b"data: a\n\n", b"data: b\n\n"], chunked=False, delay_between_s=0.05))
    with client.stream("POST", CHAT, json={}) as response:
        assert "transfer-encoding" not in response.headers
        assert response.headers["connection"] == "close"
        assert list(response.iter_raw()) == [b"data: a\n\n", b"data: b\n\n"]
    assert backend.requests[-1].completed


def test_reset_after_events(backend: FaultBackend, client: httpx.Client) -> None:
    backend.push(Sse(n_events=5, reset_after_events=2, delay_between_s=0.05))
    received = b""
    with pytest.raises(httpx.ReadError), client.stream("POST", CHAT, json={}) as response:
        for chunk in response.iter_raw():
            received += chunk
    assert len(sse_payloads(received)) == 2
    assert not backend.requests[-1].completed
    assert backend.requests[-1].disconnected_at is None  # the backend hung up, not the client


def test_reset_before_headers(backend: FaultBackend, client: httpx.Client) -> None:
    backend.push(Sse(reset_before_headers=True))
    with pytest.raises(httpx.TransportError):
        client.post(CHAT, json={})
    assert client.post(CHAT, json={}).status_code == 200  # a new connection works


def test_close_after_headers(backend: FaultBackend, client: httpx.Client) -> None:
    backend.push(Sse(close_after_headers=True))
    with client.stream("POST", CHAT, json={}) as response:
        assert response.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            response.read()


def test_big_line_event() -> None:
    event = big_line_event(100_000, model="m")
    assert len(event) == 100_000
    assert event.endswith(b"}\n\n") and event.count(b"\n") == 2
    (chunk,) = sse_payloads(event)
    assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == "m"


# -- Disconnects -----------------------------------------------------------------------------------------


def test_hang_records_the_disconnect(backend: FaultBackend, client: httpx.Client) -> None:
    backend.push(Hang())
    with pytest.raises(httpx.ReadTimeout):
        client.post(CHAT, json={}, timeout=0.2)
    disconnected_at = backend.wait_for_disconnect()
    record = backend.requests[-1]
    assert record.disconnected_at == disconnected_at > record.received_at
    assert not record.completed


def test_client_leaving_mid_stream_is_recorded(backend: FaultBackend, client: httpx.Client) -> None:
    backend.push(Trickle())  # a stream that only the client leaving ends
    with client.stream("POST", CHAT, json={}) as response:
        next(response.iter_raw())
    disconnected_at = backend.wait_for_disconnect()
    record = backend.requests[-1]
    assert record.disconnected_at == disconnected_at > record.received_at
    assert not record.completed


def test_a_trickle_streams_until_its_gate_is_set(backend: FaultBackend, client: httpx.Client) -> None:
    gate = threading.Event()
    backend.push(Trickle(gate=gate, interval_s=0.01))
    events: list[str] = []
    with client.stream("POST", CHAT, json={}) as response:
        for line in response.iter_lines():
            if line:
                events.append(line)
            if len(events) == 3:
                gate.set()
    assert events[-1] == "data: [DONE]" and len(events) >= 5
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert backend.requests[-1].completed


def test_client_leaving_during_a_delay_is_recorded(backend: FaultBackend, client: httpx.Client) -> None:
    # Recorded within the wait's bound, so during the hour's delay, not at its end.
    backend.push(Json(delay_s=3600))
    with pytest.raises(httpx.ReadTimeout):
        client.post(CHAT, json={}, timeout=0.1)
    assert backend.wait_for_disconnect(0) > backend.requests[0].received_at
    assert not backend.requests[0].completed


def test_wait_times_out(backend: FaultBackend, client: httpx.Client) -> None:
    client.get("/health")
    with pytest.raises(TimeoutError):
        backend.wait_for_disconnect(timeout_s=0.05)
    with pytest.raises(TimeoutError):
        backend.wait_for_requests(1, timeout_s=0.05, path=CHAT)
    assert [r.path for r in backend.wait_for_requests(1)] == ["/health"]


async def test_async_client_and_disconnect(backend: FaultBackend) -> None:
    backend.push(Sse(writes=[b"data: 1\n\n", b"data: 2\n\n"], delay_first_event_s=0.01), Hang())
    async with httpx.AsyncClient(base_url=backend.url, timeout=30.0) as client:
        async with client.stream("POST", CHAT, json={}) as response:
            assert [chunk async for chunk in response.aiter_raw()] == [b"data: 1\n\n", b"data: 2\n\n"]
        with pytest.raises(httpx.ReadTimeout):
            await client.post(CHAT, json={}, timeout=0.1)
    assert backend.wait_for_disconnect(1) > 0


# -- Connections and lifecycle ---------------------------------------------------------------------------


def test_keep_alive_reuses_the_connection(backend: FaultBackend, client: httpx.Client) -> None:
    client.post(CHAT, json={})
    client.post("/v1/completions", json={"stream": True})
    client.get("/health")
    assert {r.connection for r in backend.requests} == {1}
    assert all(r.completed for r in backend.requests)


def test_connection_close_is_honoured(backend: FaultBackend, client: httpx.Client) -> None:
    response = client.post(CHAT, json={}, headers={"Connection": "close"})
    assert response.headers["connection"] == "close"
    client.post(CHAT, json={})
    assert [r.connection for r in backend.requests] == [1, 2]


def test_records_and_chunked_request_bodies(backend: FaultBackend, client: httpx.Client) -> None:
    client.post(f"{CHAT}?x=1", content=iter([b'{"model":', b' "m"}']), headers={"X-Trace": "t"})
    (record,) = backend.wait_for_requests(1, path=CHAT)
    assert (record.method, record.path) == ("POST", f"{CHAT}?x=1")
    assert record.headers["transfer-encoding"] == "chunked" and record.headers["x-trace"] == "t"
    assert (record.body, record.json) == (b'{"model": "m"}', {"model": "m"})
    backend.reset()
    assert backend.requests == []


def test_malformed_input_gets_400_and_the_backend_keeps_serving(backend: FaultBackend, client: httpx.Client) -> None:
    assert raw_request(backend.port, b"NOT HTTP\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    bad_length = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nine\r\n\r\n"
    assert raw_request(backend.port, bad_length).startswith(b"HTTP/1.1 400 ")
    truncated = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 10\r\n\r\n{"
    assert raw_request(backend.port, truncated, then_eof=True) == b""
    assert client.get("/health").status_code == 200


def test_http_1_0_closes_unless_keep_alive(backend: FaultBackend) -> None:
    response = raw_request(backend.port, b"GET /health HTTP/1.0\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 200 ") and b"connection: close" in response


def test_stop_and_start_listening(backend: FaultBackend) -> None:
    backend.stop_listening()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{backend.url}/health")
    backend.start_listening()
    assert httpx.get(f"{backend.url}/health").status_code == 200


def test_stop_listening_can_drop_open_connections(backend: FaultBackend, client: httpx.Client) -> None:
    backend.push(Hang())
    failed: list[BaseException] = []

    def ask() -> None:
        try:
            client.post(CHAT, json={})
        except httpx.HTTPError as exc:
            failed.append(exc)

    asking = threading.Thread(target=ask)
    asking.start()
    backend.wait_for_requests(1, path=CHAT)  # the request is held open by the backend: now drop it
    backend.stop_listening(drop_connections=True)
    asking.join(60)
    assert len(failed) == 1 and isinstance(failed[0], httpx.RemoteProtocolError), failed
    assert backend.requests[-1].disconnected_at is None  # the backend left, not the client
    with pytest.raises(httpx.ConnectError):
        client.get("/health")


def test_loading_then_ok(backend: FaultBackend, client: httpx.Client) -> None:
    # Loading for long enough that the first probe lands inside it on a busy machine; then ready.
    backend.health = LoadingThenOk(loading_s=2)
    loading = client.get("/health")
    assert loading.status_code == 503
    assert loading.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    wait_until(lambda: client.get("/health").status_code == 200, what="the model to be loaded")
    backend.health = Status(500)
    assert client.get("/health").status_code == 500


def test_close_is_idempotent_and_final() -> None:
    backend = FaultBackend()
    backend.close()
    backend.close()
    with pytest.raises(RuntimeError):
        backend.start_listening()


def test_the_package_exports_every_behaviour_and_the_backend_in_a_sorted_all() -> None:
    exported = list(fault_backend.__all__)
    assert exported == sorted(exported)
    assert all(getattr(fault_backend, name) is not None for name in exported)
    # What a test scripts with; `_http` and `_payloads` are the server's own plumbing.
    modules = ["_answers", "_backend", "_exchange", "_gates", "_status", "_stream"]
    defined = set()
    for module in (importlib.import_module(f"tests.support.fault_backend.{name}") for name in modules):
        defined |= {name for name, value in vars(module).items() if inspect.getmodule(value) is module}
    assert {name for name in defined if not name.startswith("_")} == set(exported)
