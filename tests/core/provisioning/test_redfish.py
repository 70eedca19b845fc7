"""The Redfish client against the real emulator (sushy-tools, fake driver) on loopback: power state, each reset
and the state it leads to, refused credentials, a BMC that never answers, and hosts refused before any
connection; the answers the emulator cannot give (an unsupported reset type, no system) at the transport seam."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qiip_core import (
    BmcTimeout,
    BmcUnauthorized,
    BmcUnreachable,
    ConfigError,
    HostNotAllowed,
    PowerNotConfigured,
    ResetNotSupported,
    SystemNotFound,
)
from qiip_core.config import RedfishSettings, Settings, load_settings
from qiip_core.provisioning import RedfishClient, ResetType, check_host
from tests.support.daemon import free_port
from tests.support.redfish import PASSWORD, SYSTEM_ID, USERNAME, RedfishEmulator

HOST = "127.0.0.1"


def password_file(directory: Path, password: str = PASSWORD) -> Path:
    path = directory / "bmc-password"
    path.write_text(password + "\n")
    path.chmod(0o600)
    return path


def settings_for(tmp_path: Path, port: int, *, password: str = PASSWORD, **redfish: Any) -> Settings:
    values: dict[str, Any] = {
        "bmc_url_template": f"http://{{hostname}}:{port}",
        "username": USERNAME,
        "password_file": str(password_file(tmp_path, password)),
        **redfish,
    }
    return load_settings(state_dir=tmp_path, redfish=values)


def client_for(settings: Settings, **kwargs: Any) -> RedfishClient:
    policy = settings.routing.endpoint_policy()
    port = settings.provisioning.engine_port
    if kwargs:
        return RedfishClient(
            settings.redfish, check_host=lambda h: check_host(policy, port, h), password=PASSWORD, **kwargs
        )
    return RedfishClient.from_settings(settings.redfish, check_host=lambda h: check_host(policy, port, h))


@pytest.fixture
async def client(tmp_path: Path, redfish_emulator: RedfishEmulator) -> AsyncIterator[RedfishClient]:
    redfish = client_for(settings_for(tmp_path, redfish_emulator.port))
    yield redfish
    await redfish.aclose()


async def until_state(client: RedfishClient, state: str, timeout_s: float = 20.0) -> None:
    """Wait for the power state; the emulator's fake driver changes it 1-11 s after the reset."""
    async with asyncio.timeout(timeout_s):
        while (await client.power_state(HOST)).power_state != state:  # noqa: ASYNC110 - the BMC offers no event
            await asyncio.sleep(0.2)


@pytest.fixture
def silent_listener() -> Iterator[socket.socket]:
    """A loopback socket that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        sock.setblocking(False)
        yield sock


# -- against the emulator ----------------------------------------------------------------------------------


@pytest.mark.integration
async def test_reads_the_power_state_of_the_one_system(client: RedfishClient) -> None:
    status = await client.power_state(HOST)
    assert status.system_id == SYSTEM_ID
    assert status.power_state in {"On", "Off"}
    assert status.view() == {"host": HOST, "system_id": SYSTEM_ID, "power_state": status.power_state}


@pytest.mark.integration
async def test_each_reset_type_leads_to_its_power_state(client: RedfishClient) -> None:
    await client.reset(HOST, ResetType.FORCE_OFF)
    await until_state(client, "Off")
    before = await client.reset(HOST, ResetType.ON)
    assert before.power_state == "Off" and before.system_id == SYSTEM_ID
    await until_state(client, "On")
    for restart in (ResetType.GRACEFUL_RESTART, ResetType.FORCE_RESTART):
        assert (await client.reset(HOST, restart)).power_state == "On"
        await until_state(client, "On")
    await client.reset(HOST, ResetType.FORCE_OFF)
    await until_state(client, "Off")


@pytest.mark.integration
async def test_a_wrong_password_is_a_precise_refusal(tmp_path: Path, redfish_emulator: RedfishEmulator) -> None:
    redfish = client_for(settings_for(tmp_path, redfish_emulator.port, password="not-the-password"))
    try:
        with pytest.raises(BmcUnauthorized) as info:
            await redfish.power_state(HOST)
    finally:
        await redfish.aclose()
    assert info.value.bmc_status == 401 and info.value.status == 502
    assert "refused the credentials (401)" in info.value.message and "redfish.password_file" in info.value.message
    assert "not-the-password" not in info.value.message and PASSWORD not in info.value.message


# -- BMCs that cannot be used ------------------------------------------------------------------------------


async def test_a_bmc_that_never_answers_times_out(tmp_path: Path, silent_listener: socket.socket) -> None:
    port = silent_listener.getsockname()[1]
    redfish = client_for(settings_for(tmp_path, port, timeout_s=0.3))
    try:
        with pytest.raises(BmcTimeout) as info:
            await redfish.power_state(HOST)
    finally:
        await redfish.aclose()
    assert info.value.status == 504 and "did not answer within 0.3 s" in info.value.message


async def test_a_closed_port_is_an_unreachable_bmc(tmp_path: Path) -> None:
    redfish = client_for(settings_for(tmp_path, free_port()))
    try:
        with pytest.raises(BmcUnreachable) as info:
            await redfish.reset(HOST, ResetType.ON)
    finally:
        await redfish.aclose()
    assert info.value.message.endswith("cannot be reached: Connection refused.")


@pytest.mark.parametrize("host", ["10.20.30.40", "gpu01.example.com", "127.0.0.1/x", "{hostname}"])
async def test_a_host_outside_the_allowlist_is_refused_before_any_connection(
    tmp_path: Path, silent_listener: socket.socket, host: str
) -> None:
    redfish = client_for(settings_for(tmp_path, silent_listener.getsockname()[1], timeout_s=0.3))
    try:
        with pytest.raises(HostNotAllowed):
            await redfish.power_state(host)
        with pytest.raises(HostNotAllowed):
            await redfish.reset(host, ResetType.FORCE_OFF)
    finally:
        await redfish.aclose()
    with pytest.raises(BlockingIOError):
        silent_listener.accept()  # nobody connected


async def test_without_a_template_no_power_action_is_possible(tmp_path: Path) -> None:
    settings = load_settings(state_dir=tmp_path)
    redfish = client_for(settings)
    try:
        assert not redfish.configured
        with pytest.raises(PowerNotConfigured, match="redfish.bmc_url_template"):
            await redfish.power_state(HOST)
    finally:
        await redfish.aclose()


def test_the_password_file_must_be_private(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, 1)
    assert settings.redfish.password_file is not None
    settings.redfish.password_file.chmod(0o644)
    with pytest.raises(ConfigError, match=r"redfish.password_file .* chmod 600") as info:
        client_for(settings)
    assert PASSWORD not in info.value.message


@pytest.mark.parametrize(
    ("values", "fault"),
    [
        ({"bmc_url_template": "https://bmc.example"}, "found: none"),
        ({"bmc_url_template": "https://{hostname}.{hostname}"}, "found: {hostname}, {hostname}"),
        ({"bmc_url_template": "https://{host}-bmc"}, "found: {host}"),
        ({"bmc_url_template": "https://root:pw@{hostname}"}, "without credentials"),
        ({"username": "root"}, "go together"),
        ({"password_file": "/etc/bmc"}, "go together"),
    ],
)
def test_invalid_settings_name_the_setting(tmp_path: Path, values: dict[str, Any], fault: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(state_dir=tmp_path, redfish=values)
    assert "redfish" in info.value.message and fault in info.value.message


# -- answers the emulator does not give (the transport seam) ------------------------------------------------


def _bmc(members: int, allowed: list[str]) -> httpx.MockTransport:
    system = {
        "@odata.id": "/redfish/v1/Systems/1",
        "Id": "1",
        "PowerState": "On",
        "Actions": {
            "#ComputerSystem.Reset": {
                "target": "/redfish/v1/Systems/1/Actions/ComputerSystem.Reset",
                "ResetType@Redfish.AllowableValues": allowed,
            }
        },
    }

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/redfish/v1/Systems":
            return httpx.Response(
                200, json={"Members": [{"@odata.id": f"/redfish/v1/Systems/{i + 1}"} for i in range(members)]}
            )
        if request.method == "GET":
            return httpx.Response(200, json=system)
        return httpx.Response(204)

    return httpx.MockTransport(handle)


async def test_a_reset_type_the_system_does_not_offer_is_refused(tmp_path: Path) -> None:
    redfish = client_for(settings_for(tmp_path, 1), transport=_bmc(1, ["On", "ForceOff"]))
    try:
        await redfish.reset(HOST, ResetType.ON)
        with pytest.raises(ResetNotSupported, match="does not offer the reset type GracefulRestart") as info:
            await redfish.reset(HOST, ResetType.GRACEFUL_RESTART)
    finally:
        await redfish.aclose()
    assert info.value.status == 409


@pytest.mark.parametrize("members", [0, 2])
async def test_a_bmc_without_exactly_one_system_is_not_found(tmp_path: Path, members: int) -> None:
    redfish = client_for(settings_for(tmp_path, 1), transport=_bmc(members, ["On"]))
    try:
        with pytest.raises(SystemNotFound, match=f"lists {members} computer systems") as info:
            await redfish.power_state(HOST)
    finally:
        await redfish.aclose()
    assert info.value.status == 404


def test_the_settings_model_is_the_one_read() -> None:
    assert RedfishSettings().bmc_url_template is None


async def test_a_bmc_trickling_a_byte_at_a_time_ends_at_the_deadline_and_frees_the_host(tmp_path: Path) -> None:
    from qiip_core.discovery import EmbeddedRegistry
    from qiip_core.lifecycle import OperationRunner
    from qiip_core.provisioning import Provisioner
    from qiip_core.routing import RoutingTable

    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{" + b" " * 99_999

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Each byte comes well within the per-read timeout, so only a deadline on the whole request ends it.
        try:
            for byte in answer:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.1)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(trickle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    settings = settings_for(tmp_path, port, timeout_s=1)
    operations = OperationRunner()
    provisioner = Provisioner(settings, EmbeddedRegistry(settings), RoutingTable(), operations)
    try:
        async with asyncio.timeout(60):  # a guard only: the deadline under test is 1 s
            with pytest.raises(BmcTimeout, match=r"did not answer within 1 s in total \(waiting for its answer"):
                await provisioner.power(HOST, ResetType.ON)
        lease = await provisioner.store.acquire(HOST, "op_probe")  # the host's lease was given back
        await lease.release()
    finally:
        await provisioner.aclose()
        await operations.aclose()
        server.close()
        await server.wait_closed()
