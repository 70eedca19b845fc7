"""File descriptors: client connections are capped below the open-file limit, and the gateway's own
exhaustion never marks a node down."""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Iterator

import aiohttp
import httpx
import pytest

from qiip_core.config import load_settings
from qiip_core.routing import is_local_exhaustion, map_transport_error
from qiip_proxy._limits import MARGIN_FDS, client_connection_cap
from tests.support.daemon import Daemon, wait_until
from tests.support.fault_backend import FaultBackend


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
    with Daemon(tmp_path_factory.mktemp("capped"), env={"QIIP_SERVER__MAX_CLIENT_CONNECTIONS": "20"}) as daemon:
        yield daemon


@pytest.mark.integration
def test_idle_client_connections_beyond_the_cap_get_503_and_nodes_stay_healthy(
    capped: Daemon, backends: Callable[..., FaultBackend], model: str
) -> None:
    backend = backends()
    capped.add_node(f"{model}-n", backend.url, model)
    host, port = capped.url.removeprefix("http://").rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(25)]
    try:
        wait_until(lambda: _health_status(capped) == 503, 10, "the cap to refuse new connections")
        probes = len([r for r in backend.requests if r.path == "/health"])
        wait_until(lambda: len([r for r in backend.requests if r.path == "/health"]) > probes + 3, 10, "more probes")
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: _health_status(capped) == 200, 10, "service once the idle connections are gone")
    # The probes kept their descriptors all along: the node never went down.
    assert capped.node_statuses()[f"{model}-n"] == "healthy" and "-n: healthy -> unhealthy" not in capped.log()
    assert "serving at most 20 client connections" in capped.log()


def _health_status(daemon: Daemon) -> int:
    try:
        return httpx.get(daemon.url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0
