"""One address rule for every URL QIIP connects to from its settings: attached servers, QUADS and the hub are refused
at link-local, unspecified and cloud metadata addresses when the settings load, naming the setting, unless a network
of `routing.allowed_endpoint_networks` holds them."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

import pytest

from qiip_core import ConfigError
from qiip_core.config import load_settings
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
        ("127.0.0.1", None),
        ("10.1.2.3", None),
        ("2001:db8::1", None),
    ],
)
def test_which_addresses_are_refused(address: str, why: str | None) -> None:
    assert address_refusal(ipaddress.ip_address(address)) == why
