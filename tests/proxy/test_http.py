"""The daemon's HTTP manners toward what sits in front of it: idle connections kept open for a load
balancer's pool, `HEAD` on every `GET` route, and CORS for pages on other origins."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.daemon import Daemon, wait_until
from tests.support.fault_backend import FaultBackend, Sse

pytestmark = pytest.mark.integration

ORIGIN = "https://app.example.com"
MODEL = "http-model"
CHAT = "/v1/chat/completions"
OLD_KEEP_ALIVE_S = 5
"""uvicorn's own `timeout_keep_alive`, which the daemon used before `server.keep_alive_s`."""


@pytest.fixture(scope="module")
def backend() -> Iterator[FaultBackend]:
    with FaultBackend(model=MODEL) as backend:
        yield backend


@pytest.fixture(scope="module")
def default_daemon(tmp_path_factory: pytest.TempPathFactory, backend: FaultBackend) -> Iterator[Daemon]:
    """A daemon with the defaults of `[server]`: CORS off, the default keep-alive."""
    with Daemon(tmp_path_factory.mktemp("default")) as daemon:
        daemon.add_node("http-node", backend.url, MODEL)
        yield daemon


@pytest.fixture(scope="module")
def cors_daemon(tmp_path_factory: pytest.TempPathFactory, backend: FaultBackend) -> Iterator[Daemon]:
    env = {"QIIP_SERVER__CORS_ALLOW_ORIGINS": json.dumps([ORIGIN, "http://127.0.0.1:3000"])}
    with Daemon(tmp_path_factory.mktemp("cors"), env=env) as daemon:
        daemon.add_node("http-node", backend.url, MODEL)
        yield daemon


@contextlib.contextmanager
def connect(daemon: Daemon) -> Iterator[tuple[http.client.HTTPConnection, socket.socket]]:
    """One client connection to `daemon`, and its socket."""
    connection = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
    connection.connect()
    assert connection.sock is not None
    try:
        yield connection, connection.sock
    finally:
        connection.close()


def exchange(
    connection: http.client.HTTPConnection, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request on `connection`'s socket, its answer read whole (none for HEAD, as HTTP says)."""
    connection.request(method, path, headers=headers or {})
    response = connection.getresponse()
    body = response.read()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, body


def peer_closed(sock: socket.socket) -> bool:
    """Whether the other end has closed `sock` (it reads end of file); False while it is open and silent."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""


def health_on(connection: http.client.HTTPConnection) -> None:
    status, _, body = exchange(connection, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


# -- keep-alive ----------------------------------------------------------------------------------------------


def test_an_idle_connection_outlives_uvicorns_old_default(default_daemon: Daemon) -> None:
    with connect(default_daemon) as (connection, sock):
        health_on(connection)
        time.sleep(OLD_KEEP_ALIVE_S + 2)  # idle for longer than the old 5 s; the default keeps it far longer
        assert not peer_closed(sock)
        health_on(connection)
        assert connection.sock is sock  # the second request went on the same socket


def test_an_idle_connection_is_closed_after_keep_alive_s(tmp_path: Path) -> None:
    with Daemon(tmp_path / "short", env={"QIIP_SERVER__KEEP_ALIVE_S": "1"}) as daemon:
        with connect(daemon) as (connection, sock):
            health_on(connection)
            wait_until(lambda: peer_closed(sock), 30, "the daemon to close the idle connection")


# -- HEAD ----------------------------------------------------------------------------------------------------


def get_routes(daemon: Daemon) -> list[str]:
    """Every GET route of the daemon, from its own OpenAPI document, with its path parameters filled in."""
    values = {"model": MODEL, "node_id": "http-node", "operation_id": "op_none"}
    schema = daemon.client.get("/openapi.json").json()
    paths = [path for path, operations in schema["paths"].items() if "get" in operations] + ["/openapi.json"]
    return [path.format_map(_Filled(values)) for path in paths]


class _Filled(dict[str, str]):
    """Path parameters: the known ones, and a placeholder for any other (the route answers 404 for it)."""

    def __missing__(self, key: str) -> str:
        return f"no-such-{key}"


def test_head_answers_like_get_without_a_body_on_every_get_route(default_daemon: Daemon) -> None:
    auth = {"Authorization": "Basic " + base64.b64encode(b"admin:test-password").decode()}
    routes = get_routes(default_daemon)
    assert {"/health", "/v1/models", f"/v1/models/{MODEL}", "/metrics", "/admin/events"} <= set(routes)
    with connect(default_daemon) as (connection, sock):
        for path in routes:
            if path in ("/admin/events", "/admin/journal") or (
                path.startswith("/admin/provisioning/") and path.endswith("/logs")
            ):
                # Their GET never ends by itself: its headers are what a HEAD must match.
                with default_daemon.admin.stream("GET", path) as streamed:
                    get_status, get_headers = streamed.status_code, {k.lower(): v for k, v in streamed.headers.items()}
            else:
                get_status, get_headers, get_body = exchange(connection, "GET", path, auth)
                assert get_body
            status, headers, body = exchange(connection, "HEAD", path, auth)
            assert (status, body) == (get_status, b""), path
            # The connection stays open and nothing follows the headers: a body sent anyway would be read as
            # the start of the next answer on this socket.
            assert not peer_closed(sock)
            health_on(connection)
            varying = {"date", "x-request-id", "content-length", "transfer-encoding"}
            assert {k: v for k, v in headers.items() if k not in varying} == {
                k: v for k, v in get_headers.items() if k not in varying
            }, path
            # The length GET would have sent (the figures of /metrics and the admin views move between the two).
            assert ("content-length" in headers) == ("content-length" in get_headers), path
        assert connection.sock is sock


def test_head_on_a_post_route_answers_like_get(default_daemon: Daemon) -> None:
    get = default_daemon.client.get(CHAT)
    head = default_daemon.client.head(CHAT)
    assert get.status_code == head.status_code == 405
    assert head.headers["allow"] == get.headers["allow"] == "POST" and head.content == b""


# -- CORS ----------------------------------------------------------------------------------------------------


def preflight(
    daemon: Daemon, origin: str, *, method: str = "POST", headers: str = "authorization, content-type"
) -> httpx.Response:
    return daemon.client.options(
        CHAT,
        headers={"Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers},
    )


def chat(daemon: Daemon, origin: str, *, stream: bool) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return daemon.client.post(CHAT, json=body, headers={"Origin": origin, "Authorization": "Bearer unused"})


def test_a_preflight_from_an_allowed_origin_is_allowed(cors_daemon: Daemon) -> None:
    for origin in (ORIGIN, "http://127.0.0.1:3000"):
        answer = preflight(cors_daemon, origin)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == origin
        assert "POST" in answer.headers["access-control-allow-methods"].split(", ")
        allowed = {h.lower() for h in answer.headers["access-control-allow-headers"].split(", ")}
        assert {"authorization", "content-type"} <= allowed
        assert "access-control-allow-credentials" not in answer.headers
    # What the openai JavaScript library sends along.
    sdk = preflight(cors_daemon, ORIGIN, headers="authorization, content-type, x-stainless-os, x-stainless-lang")
    assert sdk.status_code == 200


def test_a_preflight_for_another_method_or_header_is_refused(cors_daemon: Daemon) -> None:
    for answer in (preflight(cors_daemon, ORIGIN, method="PUT"), preflight(cors_daemon, ORIGIN, headers="x-other")):
        assert answer.status_code == 400


def test_a_preflight_from_another_origin_is_refused(cors_daemon: Daemon) -> None:
    for origin in ("https://evil.example.com", "https://app.example.com:8443", "null"):
        answer = preflight(cors_daemon, origin)
        assert answer.status_code == 400
        assert "access-control-allow-origin" not in answer.headers


def test_cors_headers_on_a_plain_and_a_streamed_answer(cors_daemon: Daemon, backend: FaultBackend) -> None:
    plain = chat(cors_daemon, ORIGIN, stream=False)
    assert plain.status_code == 200 and plain.json()["choices"]
    backend.push(Sse(writes=[b'data: {"choices": []}\n\n', b"data: [DONE]\n\n"]))
    streamed = chat(cors_daemon, ORIGIN, stream=True)
    assert streamed.status_code == 200 and streamed.content.endswith(b"data: [DONE]\n\n")
    for answer in (plain, streamed):
        assert answer.headers["access-control-allow-origin"] == ORIGIN
        assert "Origin" in answer.headers["vary"]
        assert "X-Request-Id" in answer.headers["access-control-expose-headers"].split(", ")
    # An error of the inference path carries them too, so a page can read it.
    refused = cors_daemon.client.post(
        CHAT, content=b"{", headers={"Origin": ORIGIN, "Content-Type": "application/json"}
    )
    assert refused.status_code == 400 and refused.headers["access-control-allow-origin"] == ORIGIN
    # So does every other route.
    models = cors_daemon.client.get("/v1/models", headers={"Origin": ORIGIN})
    assert models.headers["access-control-allow-origin"] == ORIGIN


def test_no_cors_headers_for_another_origin(cors_daemon: Daemon) -> None:
    answer = chat(cors_daemon, "https://evil.example.com", stream=False)
    assert answer.status_code == 200
    assert "access-control-allow-origin" not in answer.headers


def test_cors_is_off_by_default(default_daemon: Daemon) -> None:
    answer = preflight(default_daemon, ORIGIN)
    assert answer.status_code == 405 and "access-control-allow-origin" not in answer.headers
    for response in (
        chat(default_daemon, ORIGIN, stream=False),
        default_daemon.client.get("/v1/models", headers={"Origin": ORIGIN}),
    ):
        assert response.status_code == 200
        assert not any(name.startswith("access-control-") for name in response.headers)
