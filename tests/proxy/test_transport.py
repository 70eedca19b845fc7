"""Transport limits on client connections: header size (431), header and body deadlines (408), and
connections per address (503), answered by the server before the app sees a request."""

from __future__ import annotations

import select
import socket
from collections.abc import Iterator

import pytest

from tests.support.daemon import Daemon, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    env = {
        "QIIP_SERVER__MAX_HEADER_BYTES": "8192",
        "QIIP_SERVER__HEADER_TIMEOUT_S": "1",
        "QIIP_SERVER__BODY_TIMEOUT_S": "1",
        "QIIP_SERVER__MAX_CONNECTIONS_PER_ADDRESS": "6",
    }
    with Daemon(tmp_path_factory.mktemp("strict"), env=env) as daemon:
        yield daemon


def connect(daemon: Daemon) -> socket.socket:
    host, port = daemon.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=15)


def answer_to(sock: socket.socket, data: bytes) -> bytes:
    if data:
        sock.sendall(data)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_headers_over_the_limit_get_431(strict: Daemon) -> None:
    with connect(strict) as sock:
        answer = answer_to(sock, b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431")


def test_a_header_value_that_never_ends_is_refused_once_it_passes_the_limit(strict: Daemon) -> None:
    # The value is dribbled and never ends: the parser holds it until its end, so the limit is counted as it comes.
    sent = 0
    with connect(strict) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        try:
            while sent < 4 << 20 and not select.select([sock], [], [], 0.02)[0]:
                sock.sendall(b"a" * 4096)
                sent += 4096
        except OSError:
            pass  # closed by the server while we were sending
        answer = answer_to(sock, b"")
    # Refused for its size while still unfinished (it never ends): without the count it would wait for 408.
    assert answer.startswith(b"HTTP/1.1 431"), answer[:80]


def test_headers_that_never_finish_get_408(strict: Daemon) -> None:
    with connect(strict) as sock:
        answer = answer_to(sock, b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
    assert answer.startswith(b"HTTP/1.1 408")
    with connect(strict) as silent:
        assert answer_to(silent, b"").startswith(b"HTTP/1.1 408")  # nothing sent at all


def test_a_body_that_never_finishes_gets_408(strict: Daemon) -> None:
    with connect(strict) as sock:
        answer = answer_to(
            sock,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": ',
        )
    assert answer.startswith(b"HTTP/1.1 408")


def test_an_address_holding_too_many_connections_gets_503(strict: Daemon) -> None:
    held = [connect(strict) for _ in range(6)]
    try:
        with connect(strict) as extra:
            # Answered as soon as it opens, before any request.
            assert answer_to(extra, b"").startswith(b"HTTP/1.1 503")
    finally:
        for sock in held:
            sock.close()

    def served() -> bool:
        with connect(strict) as sock:
            return answer_to(sock, b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").startswith(
                b"HTTP/1.1 200"
            )

    wait_until(served, what="a connection once the others closed")
