"""File descriptors: client connections are capped below the open-file limit as they are accepted, and the gateway's
own exhaustion never marks a node down."""

from __future__ import annotations

import errno
import http.client
import json
import socket
import threading
from collections.abc import Callable, Iterator

import aiohttp
import httpx
import pytest

from qiip_core.config import load_settings
from qiip_core.routing import is_local_exhaustion, map_transport_error
from qiip_proxy._limits import MARGIN_FDS, client_connection_cap
from tests.support.daemon import Daemon, closed_by_server, wait_until
from tests.support.fault_backend import Completion, FaultBackend, Gated


def test_the_derived_cap_keeps_room_for_nodes_and_probes() -> None:
    settings = load_settings()
    # 1,024 files: half at most for nodes (1,024 wanted), 64 probes, the margin.
    assert client_connection_cap(settings, 1024) == 1024 - 512 - settings.health.concurrency - MARGIN_FDS
    assert client_connection_cap(settings, 100) == 16
    assert client_connection_cap(settings, 10_000_000) == 65_536


def test_running_out_of_file_descriptors_is_the_gateways_own_failure() -> None:
    exhausted = OSError(errno.EMFILE, "Too many open files")
    connector_error = aiohttp.ClientConnectorError(
        aiohttp.client_reqrep.ConnectionKey("h", 1, False, True, None, None, None), exhausted
    )
    assert is_local_exhaustion(exhausted) and is_local_exhaustion(connector_error)
    assert map_transport_error(connector_error, "n").local
    refused = OSError(errno.ECONNREFUSED, "refused")
    assert not is_local_exhaustion(refused)
    assert not map_transport_error(aiohttp.ClientConnectorError(connector_error._conn_key, refused), "n").local


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("capped"), env={"QIIP_SERVER__MAX_CLIENT_CONNECTIONS": "4"}) as daemon:
        yield daemon


@pytest.mark.integration
def test_idle_connections_over_the_cap_make_room_and_busy_ones_refuse_the_next_at_accept(
    capped: Daemon, backends: Callable[..., FaultBackend], model: str
) -> None:
    backend = backends()
    capped.add_node(f"{model}-n", backend.url, model)
    host, port = capped.url.removeprefix("http://").rsplit(":", 1)
    # Silent connections: past the cap of 4, each new one takes the place of the one silent longest.
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(10)]
    try:
        wait_until(lambda: sum(not closed_by_server(sock) for sock in idle) == 4, what="all but 4 closed")
        assert not any(closed_by_server(sock) for sock in idle[-4:])
        assert _health_status(capped) == 200
    finally:
        for sock in idle:
            sock.close()
    # Four requests in progress: nothing to make room with, so the next connection is refused as it is accepted.
    gate = threading.Event()
    backend.push(*[Gated(gate, Completion()) for _ in range(4)])
    held = []
    try:
        for n in range(1, 5):
            connection = http.client.HTTPConnection(host, int(port), timeout=30)
            body = json.dumps({"model": model, "messages": []})
            connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            held.append(connection)
            backend.wait_for_requests(n, 10, path="/v1/chat/completions")
        refused = socket.create_connection((host, int(port)), timeout=10)
        with refused:
            answer = refused.makefile("rb").read()
        assert answer.startswith(b"HTTP/1.1 503 ") and b"\r\nretry-after: 1\r\n" in answer.lower(), answer
        probes = len([r for r in backend.requests if r.path == "/health"])
        wait_until(lambda: len([r for r in backend.requests if r.path == "/health"]) > probes + 3, what="more probes")
    finally:
        gate.set()
    assert [connection.getresponse().status for connection in held] == [200] * 4
    for connection in held:
        connection.close()
    wait_until(lambda: _health_status(capped) == 200, what="service once the requests are done")
    # The probes kept their descriptors all along: the node never went down.
    assert capped.node_statuses()[f"{model}-n"] == "healthy" and "-n: healthy -> unhealthy" not in capped.log()
    assert "serving at most 4 client connections" in capped.log()
    assert "at the cap of 4 client connections: " in capped.log()


def _health_status(daemon: Daemon) -> int:
    try:
        return httpx.get(daemon.url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0
