"""One address rule for every URL QIIP connects to from its settings: attached servers, QUADS and the hub are refused
at link-local, unspecified and cloud metadata addresses when the settings load, naming the setting, unless a network
of `routing.allowed_endpoint_networks` holds them."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

import pytest

from qiip_core import ConfigError
from qiip_core.config import check_settings_names, load_settings
from qiip_core.nodes import address_refusal

pytestmark = pytest.mark.usefixtures("clean_env")


def attached(url: str) -> dict[str, str]:
    return {"QIIP_ATTACHED": f'[{{"name": "hosted", "url": "{url}", "model": "m"}}]'}


def quads(url: str) -> dict[str, str]:
    return {"QIIP_QUADS__URL": url, "QIIP_QUADS__TIMEZONE": "UTC"}


def hub(url: str) -> dict[str, str]:
    return {"QIIP_MODELS__HUB_ENDPOINT": url}


SETTINGS: dict[str, Callable[[str], dict[str, str]]] = {
    "attached[0].url (hosted)": attached,
    "quads.url": quads,
    "models.hub_endpoint": hub,
}

REFUSED = {
    "https://169.254.169.254": "link-local",
    "https://[fe80::1]": "link-local",
    "https://0.0.0.0": "unspecified",
    "https://[::]": "unspecified",
    "https://[fd00:ec2::254]": "cloud metadata",
    "https://[::ffff:169.254.169.254]": "link-local",
    "https://[64:ff9b::a9fe:a9fe]": "link-local",  # NAT64: reaches 169.254.169.254
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("url", list(REFUSED))
def test_a_settings_url_at_a_refused_address_is_refused_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, setting: str, url: str
) -> None:
    for key, value in SETTINGS[setting](url).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as refused:
        load_settings()
    message = str(refused.value)
    assert f"{setting}: " in message and REFUSED[url] in message and "routing.allowed_endpoint_networks" in message


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_full_width_address_is_judged_as_the_address_it_maps_to_or_refused_as_no_url(
    monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    """aiohttp maps `１６９．２５４．１６９．２５４` through IDNA to 169.254.169.254 and connects to it as a literal,
    without a resolver; httpx refuses the name. Either way the settings do not load."""
    for key, value in SETTINGS[setting]("https://１６９．２５４．１６９．２５４").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert setting.split(" ")[0] in caught.value.message
    assert "link-local" in caught.value.message or "is not a URL" in caught.value.message


def test_an_allowed_network_lets_such_an_address_be_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in attached("https://169.254.10.20").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("QIIP_ROUTING__ALLOWED_ENDPOINT_NETWORKS", '["169.254.10.0/24"]')
    assert load_settings().attached[0].url == "https://169.254.10.20:443"


@pytest.mark.parametrize("url", ["https://api.example.com", "https://10.0.0.5:8443", "http://127.0.0.1:8000"])
def test_names_and_ordinary_addresses_load(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    for key, value in attached(url).items():
        monkeypatch.setenv(key, value)
    assert load_settings().attached[0].model == "m"


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("169.254.0.1", "a link-local address"),
        ("fe80::abcd", "a link-local address"),
        ("0.0.0.0", "an unspecified address"),
        ("::", "an unspecified address"),
        ("fd00:ec2::254", "a cloud metadata address"),
        ("100.100.100.200", "a cloud metadata address"),
        ("168.63.129.16", "a cloud metadata address"),
        ("64:ff9b::a9fe:a9fe", "a link-local address"),
        ("::a9fe:a9fe", "a link-local address"),
        ("::ffff:0.0.0.0", "an unspecified address"),
        ("::1", None),
        ("::ffff:127.0.0.1", None),
        ("127.0.0.1", None),
        ("10.1.2.3", None),
        ("2001:db8::1", None),
    ],
)
def test_which_addresses_are_refused(address: str, why: str | None) -> None:
    assert address_refusal(ipaddress.ip_address(address)) == why


@pytest.fixture
def names(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """A stand-in resolver (nothing leaves loopback): names in the table resolve to their addresses; each lookup is
    recorded under the key `asked`."""
    from qiip_core.nodes import _connect

    table: dict[str, list[str]] = {"asked": []}

    def resolve(host: str, port: int) -> list[str]:
        table["asked"].append(host)
        if host not in table:
            raise OSError(f"{host}: Name or service not known")
        return table[host]

    monkeypatch.setattr(_connect, "resolve", resolve)
    return table


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_name_resolving_to_a_refused_address_stops_the_start_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, names: dict[str, list[str]], setting: str
) -> None:
    for key, value in SETTINGS[setting]("https://service.lab").items():
        monkeypatch.setenv(key, value)
    names["service.lab"] = ["10.0.0.7", "169.254.169.254"]
    with pytest.raises(ConfigError) as caught:
        check_settings_names(load_settings())
    assert caught.value.message.startswith(
        f"{setting}: service.lab (which resolves to 169.254.169.254) is a link-local address"
    )
    monkeypatch.setenv("QIIP_ROUTING__ALLOWED_ENDPOINT_NETWORKS", '["169.254.169.0/24"]')
    check_settings_names(load_settings())


def test_names_that_resolve_well_or_not_at_all_start_and_the_default_hub_is_not_looked_up(
    monkeypatch: pytest.MonkeyPatch, names: dict[str, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    check_settings_names(load_settings())  # the default hub endpoint: not the operator's, not resolved at start
    assert names["asked"] == []
    for key, value in {**attached("https://localhost:1"), **quads("https://quads.lab")}.items():
        monkeypatch.setenv(key, value)
    names["localhost"] = ["127.0.0.1", "::1"]
    with caplog.at_level("WARNING", logger="qiip.config"):
        check_settings_names(load_settings())
    assert sorted(names["asked"]) == ["localhost", "quads.lab"]
    assert "quads.url: 'quads.lab' cannot be resolved now" in caplog.text
