"""The daemon's HTTP manners toward what sits in front of it: idle connections kept open for a load
balancer's pool."""

from __future__ import annotations

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

pytestmark = pytest.mark.integration

OLD_KEEP_ALIVE_S = 5
"""uvicorn's own `timeout_keep_alive`, which the daemon used before `server.keep_alive_s`."""


@pytest.fixture(scope="module")
def default_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon with the defaults of `[server]`."""
    with Daemon(tmp_path_factory.mktemp("default")) as daemon:
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
    """One request on `connection`'s socket, its answer read whole."""
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
