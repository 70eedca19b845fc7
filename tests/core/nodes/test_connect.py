"""The address rule at connect time: a settings URL's name is resolved when it is connected to, refused when any
address it resolves to is link-local, unspecified or a metadata address, and connected to at the address checked.

Names here resolve through a stand-in resolver (nothing leaves loopback); connections go to real servers on
127.0.0.1: the QUADS stand-in, the loopback hub, an HTTPS file server.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from qiip_core import DownloadFailed, QuadsUnavailable
from qiip_core.catalog import Download, download_files
from qiip_core.config import ModelSettings
from qiip_core.nodes import (
    AddressRefused,
    _connect,
    allowed_addresses,
    checked_async_transport,
    checked_create_connection,
)
from qiip_core.quads import QuadsClient
from tests.support.fake_hub import FakeHub
from tests.support.quads import QuadsServer

METADATA = "169.254.169.254"


@pytest.fixture
def names(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """A stand-in resolver: names added to the returned table resolve to their addresses, others fail as unknown."""
    table: dict[str, list[str]] = {}

    def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return table[host]

    monkeypatch.setattr(_connect, "resolve", resolve)
    return table


@pytest.mark.parametrize(
    ("address", "why"),
    [
        (METADATA, "a link-local address"),
        ("fe80::1", "a link-local address"),
        ("0.0.0.0", "an unspecified address"),
        ("::", "an unspecified address"),
        ("fd00:ec2::254", "a cloud metadata address"),
        ("::ffff:169.254.169.254", "a link-local address"),
    ],
)
def test_a_name_resolving_to_a_refused_address_is_refused_naming_the_setting(
    names: dict[str, list[str]], address: str, why: str
) -> None:
    names["quads.lab"] = [address]
    with pytest.raises(AddressRefused) as caught:
        allowed_addresses("quads.lab", 80, setting="quads.url")
    assert str(caught.value) == (
        f"quads.url: quads.lab (which resolves to {address}) is {why}, which QIIP does not connect to; add a "
        "network holding it to routing.allowed_endpoint_networks to allow it"
    )
    assert (caught.value.setting, caught.value.host, caught.value.address) == ("quads.url", "quads.lab", address)


def test_one_refused_address_among_several_refuses_the_name(names: dict[str, list[str]]) -> None:
    names["mixed.lab"] = ["127.0.0.1", METADATA]
    with pytest.raises(AddressRefused, match="169.254.169.254"):
        allowed_addresses("mixed.lab", 80, setting="quads.url")


def test_allowed_names_and_literals_pass_and_an_operators_network_allows_what_the_rule_refuses(
    names: dict[str, list[str]],
) -> None:
    names["bmc.lab"] = ["127.0.0.5", "::1"]
    assert allowed_addresses("bmc.lab", 443, setting="redfish.bmc_url_template") == ["127.0.0.5", "::1"]
    assert allowed_addresses("127.0.0.1", 80, setting="quads.url") == ["127.0.0.1"]
    assert allowed_addresses("[::1]", 80, setting="quads.url") == ["::1"]
    with pytest.raises(AddressRefused, match="is a link-local address"):
        allowed_addresses(METADATA, 80, setting="quads.url")
    networks = [ipaddress.ip_network("169.254.0.0/16")]
    names["lab.metadata"] = [METADATA]
    assert allowed_addresses("lab.metadata", 80, setting="quads.url", networks=networks) == [METADATA]
    with pytest.raises(OSError, match="not known"):
        allowed_addresses("nowhere.lab", 80, setting="quads.url")


async def test_quads_by_name_is_connected_to_at_the_address_checked_and_a_refused_name_reaches_nothing(
    names: dict[str, list[str]],
) -> None:
    with QuadsServer() as quads:
        quads.add_host("host1.lab")
        names["quads.lab"] = ["127.0.0.1"]
        client = QuadsClient(f"http://quads.lab:{quads.port}", "UTC")
        try:
            assert [h.name for h in await client.hosts()] == ["host1.lab"]
        finally:
            await client.aclose()
        seen = len(quads.requests)
        names["quads.lab"] = [METADATA]  # the name now points elsewhere: the next connection is judged again
        client = QuadsClient(f"http://quads.lab:{quads.port}", "UTC")
        try:
            with pytest.raises(QuadsUnavailable) as caught:
                await client.hosts()
        finally:
            await client.aclose()
        assert "quads.url: quads.lab (which resolves to 169.254.169.254) is a link-local address" in str(caught.value)
        assert len(quads.requests) == seen


async def test_the_transport_refuses_before_any_connection_with_httpx_own_connect_error(
    names: dict[str, list[str]],
) -> None:
    names["bmc1.lab"] = ["0.0.0.0"]
    transport = checked_async_transport(setting="redfish.bmc_url_template")
    async with httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(httpx.ConnectError, match=r"redfish.bmc_url_template: bmc1.lab .* unspecified address"):
            await client.get("https://bmc1.lab/redfish/v1")


def test_an_acquisition_source_by_name_is_refused_at_connect_time(names: dict[str, list[str]]) -> None:
    names["mirror.lab"] = ["fe80::1"]
    connect = checked_create_connection(setting="the source of model.gguf")
    with pytest.raises(AddressRefused, match="the source of model.gguf: mirror.lab .* link-local"):
        connect(("mirror.lab", 443), 5)
    listener = socket.create_server(("127.0.0.1", 0))
    with listener:
        names["mirror.lab"] = ["127.0.0.1"]
        with connect(("mirror.lab", listener.getsockname()[1]), 5) as conn:
            assert conn.getpeername()[0] == "127.0.0.1"


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FakeHub]:
    readme = tmp_path / "README.md"
    readme.write_text("# tiny\n")
    fake = FakeHub()
    fake.add("qiip-test/readme", "c0ffee" + "0" * 34, {"README.md": readme})
    with fake.running():
        yield fake


def test_the_hub_by_a_name_that_resolves_to_a_metadata_address_is_never_asked(
    tmp_path: Path, hub: FakeHub, names: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import close_session, constants
    from huggingface_hub.utils._runtime import is_xet_available

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    port = hub.endpoint.rsplit(":", 1)[1]
    names["hub.lab"] = ["127.0.0.1"]
    settings = ModelSettings(hub_endpoint=f"http://hub.lab:{port}")
    download = Download(id="dl_ok", repo_id="qiip-test/readme", revision="main", files=("README.md",))
    download_files(download, settings=settings, cache_dir=tmp_path / "cache")
    assert download.bytes_done == len("# tiny\n")
    # A file the hub stores with Xet never goes to hf_xet's own sockets, which no check sees.
    assert not is_xet_available()
    asked = len(hub.requests)
    close_session()  # a kept-alive connection was made to the address checked; the next one is judged again
    names["hub.lab"] = ["fd00:ec2::254"]
    refused = Download(id="dl_refused", repo_id="qiip-test/readme", revision="main", files=("README.md",))
    with pytest.raises(DownloadFailed, match=r"models.hub_endpoint .*hub.lab .*fd00:ec2::254.* metadata address"):
        download_files(refused, settings=settings, cache_dir=tmp_path / "other")
    assert len(hub.requests) == asked
