"""The inference paths the HTTP server answers itself (`qiip_proxy/server/_fast.py`) answer as the ASGI way does:
the same request through both (the exact path is direct; the same path with a query string goes through the ASGI
layers to the same handler) gets the same status, headers and body, refusals included; and the HTTP the direct
way speaks itself (100-continue, pipelining, HTTP/1.0, chunked uploads, a cut stream) holds, on a real daemon."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.daemon import Daemon, wait_until
from tests.support.fault_backend import FaultBackend, Json, Sse

pytestmark = pytest.mark.integration

MODEL = "direct-model"
DIRECT = "/v1/chat/completions"
VIA_ASGI = "/v1/chat/completions?via=asgi"
"""The same handler behind every ASGI layer: the server answers only the exact path itself."""

ANSWER = {"id": "c1", "object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}


@pytest.fixture(scope="module")
def backend() -> Iterator[FaultBackend]:
    with FaultBackend(model=MODEL) as node:
        yield node


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, backend: FaultBackend) -> Iterator[Daemon]:
    env = {"QIIP_ROUTING__POLICY": "least_connections", "QIIP_SERVER__MAX_BODY_BYTES": "4096"}
    with Daemon(tmp_path_factory.mktemp("direct"), env=env) as running:
        running.add_node("direct-node", backend.url, MODEL)
        yield running


def body(stream: object = False, **extra: object) -> bytes:
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream, **extra}
    ).encode()


def raw(daemon: Daemon, data: bytes, *, until: bytes, timeout_s: float = 30.0) -> bytes:
    """Send `data` on a new connection and read until `until` has come (or the daemon closes)."""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=timeout_s) as sock:
        sock.sendall(data)
        received = b""
        while until not in received:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                raise AssertionError(f"only {received!r} came") from None
            if not chunk:
                break
            received += chunk
        return received


def compared(response: httpx.Response) -> tuple[int, dict[str, str], bytes]:
    """An answer as both ways must give it: the headers that differ by nature (the date, the request id) left out."""
    headers = {k: v for k, v in response.headers.items() if k not in ("date", "x-request-id")}
    return response.status_code, headers, response.content


def test_an_answer_is_the_same_whichever_way_the_server_takes_it(daemon: Daemon, backend: FaultBackend) -> None:
    with httpx.Client(base_url=daemon.url, timeout=30) as client:
        answers = []
        for path in (DIRECT, VIA_ASGI):
            backend.push(Json(body=ANSWER))
            answers.append(compared(client.post(path, content=body(), headers={"content-type": "application/json"})))
        assert answers[0] == answers[1] and answers[0][0] == 200 and json.loads(answers[0][2]) == ANSWER
        streams = []
        for path in (DIRECT, VIA_ASGI):
            backend.push(Sse(events=[b'data: {"choices": []}\n\n'] * 3))
            streams.append(
                compared(client.post(path, content=body(stream=True), headers={"content-type": "application/json"}))
            )
        assert streams[0] == streams[1]
        assert streams[0][2] == b'data: {"choices": []}\n\n' * 3 + b"data: [DONE]\n\n"
        assert streams[0][1]["transfer-encoding"] == "chunked" and streams[0][1]["x-qiip-node"] == "direct-node"


@pytest.mark.parametrize(
    ("content", "headers", "status", "code"),
    [
        (b'{"model": "direct-model", "model": "other"}', {"content-type": "application/json"}, 400, "invalid_json"),
        (b"{not json", {"content-type": "application/json"}, 400, "invalid_json"),
        (body(), {"content-type": "text/plain"}, 415, "unsupported_media_type"),
        (body(padding="x" * 5000), {"content-type": "application/json"}, 413, "request_too_large"),
        (body(), {"content-type": "application/json", "host": "evil.example.com"}, 421, "host_not_allowed"),
        (body(stream="yes"), {"content-type": "application/json"}, 400, "invalid_type"),
    ],
    ids=["duplicate-key", "not-json", "not-json-type", "too-large", "host", "bad-stream"],
)
def test_a_refusal_is_the_same_openai_error_whichever_way(
    daemon: Daemon, content: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    with httpx.Client(base_url=daemon.url, timeout=30) as client:
        answers = [compared(client.post(path, content=content, headers=headers)) for path in (DIRECT, VIA_ASGI)]
    assert answers[0] == answers[1]
    assert answers[0][0] == status and json.loads(answers[0][2])["error"]["code"] == code


def test_a_client_that_expects_100_continue_gets_it_then_its_answer(daemon: Daemon, backend: FaultBackend) -> None:
    backend.push(Json(body=ANSWER))
    payload = body()
    head = (
        b"POST %s HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"expect: 100-continue\r\n\r\n" % (DIRECT.encode(), len(payload))
    )
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as sock:
        sock.sendall(head)
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(payload)
        answer = b""
        while b'"c1"' not in answer:
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer


def test_pipelined_requests_are_answered_in_order_on_one_connection(daemon: Daemon, backend: FaultBackend) -> None:
    first, second = {**ANSWER, "id": "first"}, {**ANSWER, "id": "second"}
    backend.push(Json(body=first), Json(body=second))
    payload = body()
    request = (
        b"POST %s HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (
            DIRECT.encode(),
            len(payload),
            payload,
        )
    )
    answers = raw(daemon, request * 2, until=b'"id":"second"')
    assert answers.count(b"HTTP/1.1 200 OK\r\n") == 2
    assert answers.index(b'"id":"first"') < answers.index(b'"id":"second"')


def test_an_http_1_0_client_gets_its_answer_and_the_connection_closes(daemon: Daemon, backend: FaultBackend) -> None:
    backend.push(Json(body=ANSWER))
    payload = body()
    request = (
        b"POST %s HTTP/1.0\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (
            DIRECT.encode(),
            len(payload),
            payload,
        )
    )
    answer = raw(daemon, request, until=b"\0never")  # read to the daemon's close
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nconnection: close" in head
    assert json.loads(rest) == ANSWER


def test_a_chunked_upload_is_read_whole(daemon: Daemon, backend: FaultBackend) -> None:
    backend.push(Json(body=ANSWER))
    payload = body()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (payload[:10], payload[10:])) + b"0\r\n\r\n"
    request = (
        b"POST %s HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        % DIRECT.encode()
    )
    answer = raw(daemon, request + chunks, until=b'"c1"')
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert backend.requests[-1].body == payload


def test_a_stream_cut_mid_way_ends_with_an_error_event_then_done(daemon: Daemon, backend: FaultBackend) -> None:
    backend.push(Sse(n_events=5, reset_after_events=2))
    with httpx.Client(base_url=daemon.url, timeout=30) as client:
        answer = client.post(DIRECT, content=body(stream=True), headers={"content-type": "application/json"})
    events = [event for event in answer.text.split("\n\n") if event]
    assert answer.status_code == 200 and len(events) == 4
    assert json.loads(events[2].removeprefix("data: "))["error"]["code"] == "backend_transport_error"
    assert events[3] == "data: [DONE]"


def test_a_client_leaving_mid_stream_closes_the_nodes_request(daemon: Daemon, backend: FaultBackend) -> None:
    backend.push(Sse(n_events=2, stall_after_events=1))
    payload = body(stream=True)
    request = (
        b"POST %s HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (
            DIRECT.encode(),
            len(payload),
            payload,
        )
    )
    seen = len(backend.requests)
    raw(daemon, request, until=b"tok0")  # the first event came; the socket is closed on return
    backend.wait_for_disconnect(seen)
    wait_until(lambda: daemon.in_flight("direct-node") == 0, what="the reservation released")


@pytest.fixture(scope="module")
def impatient(tmp_path_factory: pytest.TempPathFactory, backend: FaultBackend) -> Iterator[Daemon]:
    """A daemon whose nodes may be silent for 1 s at most between two pieces of an answer."""
    env = {"QIIP_ROUTING__POLICY": "least_connections", "QIIP_UPSTREAM__IDLE_TIMEOUT_S": "1"}
    with Daemon(tmp_path_factory.mktemp("impatient"), env=env) as running:
        running.add_node("direct-node", backend.url, MODEL)
        yield running


def test_a_client_that_stops_reading_holds_the_node_back_and_still_gets_every_event(
    impatient: Daemon, backend: FaultBackend
) -> None:
    # 24 MiB of events: more than every buffer on the way can hold while the client reads nothing for 2.5 s,
    # longer than the idle limit; the node is held back meanwhile (it is not silent: the client is slow), and
    # the stream then arrives whole.
    events = [b'data: {"n": %d, "pad": "%s"}\n\n' % (i, b"x" * 8000) for i in range(3000)]
    backend.push(Sse(events=events))
    payload = body(stream=True)
    request = (
        b"POST %s HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (
            DIRECT.encode(),
            len(payload),
            payload,
        )
    )
    with socket.create_connection(("127.0.0.1", impatient.port), timeout=30) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.sendall(request)
        time.sleep(2.5)
        received = b""
        while not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
            chunk = sock.recv(1 << 20)
            assert chunk, received[-200:]
            received += chunk
    relayed = b"".join(part for part in received.split(b"\r\n") if part.startswith(b"data: "))
    assert relayed.count(b"data: {") == 3000 and b'"error"' not in received
    assert relayed.index(b'"n": 2999') > relayed.index(b'"n": 0')
