"""The daemon's HTTP manners toward what sits in front of it: idle connections kept open for a load
balancer's pool, and `HEAD` on every `GET` route."""

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

import pytest

from tests.support.daemon import Daemon, wait_until
from tests.support.fault_backend import FaultBackend

pytestmark = pytest.mark.integration

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
    """A daemon with the defaults of `[server]`, serving one fault backend's model."""
    with Daemon(tmp_path_factory.mktemp("default")) as daemon:
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
    return [path.format(**values) for path in paths]


def test_head_answers_like_get_without_a_body_on_every_get_route(default_daemon: Daemon) -> None:
    auth = {"Authorization": "Basic " + base64.b64encode(b"admin:test-password").decode()}
    routes = get_routes(default_daemon)
    assert {"/health", "/v1/models", f"/v1/models/{MODEL}", "/metrics", "/admin/events"} <= set(routes)
    with connect(default_daemon) as (connection, sock):
        for path in routes:
            if path == "/admin/events":
                # Its GET never ends by itself: its headers are what a HEAD must match.
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
