"""Fixtures of the provisioning tests: loopback SSH hosts, the driver mirror, and a provisioner wired like the
daemon's (an embedded registry feeding a routing table)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from qiip_core.config import Settings, load_settings
from qiip_core.discovery import EmbeddedRegistry, RegistryEvent, RegistryEventKind
from qiip_core.lifecycle import Operation, OperationRunner, OperationState
from qiip_core.provisioning import Provisioner
from qiip_core.routing import RoutingTable
from tests.support.daemon import free_port
from tests.support.sshd import DRIVER_VERSION, DriverServer, SshHosts


@pytest.fixture(scope="session")
def driver_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DriverServer]:
    with DriverServer(tmp_path_factory.mktemp("driver")) as server:
        yield server


@pytest.fixture(scope="module")
def ssh_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    """Eight loopback hosts (127.0.0.2–9), RHEL family at even indexes, Debian at odd ones, with nvidia-smi."""
    with SshHosts(tmp_path_factory.mktemp("ssh"), 8) as hosts:
        for host in hosts.hosts:
            host.preinstall_vllm()
        yield hosts


def provisioning_settings(
    state_dir: Path, hosts: SshHosts, driver: DriverServer, *, engine_port: int, **provisioning: Any
) -> Settings:
    values: dict[str, Any] = {
        "ssh_port": hosts.port,
        "ssh_key_file": str(hosts.client_key),
        "known_hosts_file": str(hosts.known_hosts),
        "engine_port": engine_port,
        "nvidia_driver_version": DRIVER_VERSION,
        "nvidia_driver_sha256": driver.sha256,
        "nvidia_driver_url_template": driver.url_template,
        "health_interval_s": 0.1,
        "health_timeout_s": 30,
        "min_free_disk_gib": 0.01,
        "ssh_wait_timeout_s": 1,
        "connect_timeout_s": 10,
        **provisioning,
    }
    return load_settings(state_dir=state_dir, provisioning=values, registry={"poll_interval_s": 0.05})


async def until(predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Wait until `predicate()` holds (what a background task or a remote process brings about)."""
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - the operation and the host offer no event to wait on
            await asyncio.sleep(0.05)


class Harness:
    """A provisioner with an embedded registry feeding a routing table, as the daemon wires them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.table = RoutingTable()
        self.registry = EmbeddedRegistry(settings)
        self.operations = OperationRunner()
        self.provisioner = Provisioner(settings, self.registry, self.table, self.operations)

    def _apply(self, event: RegistryEvent) -> None:
        if event.kind is RegistryEventKind.PUT and event.node is not None:
            self.table.apply_put(event.node, source=event.source)
        elif event.kind is RegistryEventKind.DELETE:
            self.table.apply_delete(event.node_id)

    async def wait(self, operation: Operation, timeout_s: float = 120.0) -> Operation:
        await until(lambda: operation.state is not OperationState.RUNNING, timeout_s)
        return operation

    async def aclose(self) -> None:
        await self.operations.aclose()
        await self.provisioner.aclose()
        await self.registry.aclose()


@pytest.fixture
def engine_port() -> int:
    return free_port()


@pytest.fixture
async def harness(
    tmp_path: Path, ssh_hosts: SshHosts, driver_server: DriverServer, engine_port: int
) -> AsyncIterator[Harness]:
    h = Harness(provisioning_settings(tmp_path / "state", ssh_hosts, driver_server, engine_port=engine_port))
    await h.registry.start(h._apply)
    yield h
    await h.aclose()
