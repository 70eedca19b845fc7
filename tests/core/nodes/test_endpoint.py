from __future__ import annotations

import pytest

from qiip_core import EndpointError, EndpointNotAllowed
from qiip_core.nodes import EndpointPolicy, parse_endpoint


@pytest.mark.parametrize(
    ("raw", "url"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("HTTP://LocalHost:8000/", "http://localhost:8000"),
        ("https://gpu01.lab.:8443", "https://gpu01.lab:8443"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("http://[0:0:0:0:0:0:0:1]:8000", "http://[::1]:8000"),
        ("http://[::ffff:127.0.0.1]:8000", "http://127.0.0.1:8000"),
        ("  http://localhost:1  ", "http://localhost:1"),
    ],
)
def test_parse_normalises(raw: str, url: str) -> None:
    assert parse_endpoint(raw).url == url


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("http://localhost", "no port"),
        ("http://localhost:8000/v1", "path"),
        ("http://localhost:8000?x=1", "query"),
        ("http://localhost:8000#frag", "query or fragment"),
        ("http://user:pw@localhost:8000", "userinfo"),
        ("http://user@localhost:8000", "userinfo"),
        ("ftp://localhost:21", "scheme"),
        ("http://localhost:0", "port 0"),
        ("http://localhost:70000", "cannot be parsed"),
        ("http://2130706433:8000", "numeric host"),
        ("http://0177.0.0.1:8000", "numeric host"),
        ("http://0x7f.0.0.1:8000", "numeric host"),
        ("http://127.1:8000", "numeric host"),
        ("http://[fe80::1%25eth0]:8000", "zone id"),
        ("http://bücher.lab:8000", "non-ASCII"),
        ("http://bad_host.lab:8000", "invalid host"),
        ("", "empty"),
        ("http://local host:8000", "whitespace"),
        ("http://:8000", "no host"),
    ],
)
def test_parse_rejects(raw: str, fragment: str) -> None:
    with pytest.raises(EndpointError) as info:
        parse_endpoint(raw)
    assert fragment in info.value.message


def test_default_policy_is_loopback_only() -> None:
    policy = EndpointPolicy()
    assert policy.check("http://127.0.0.5:9").url == "http://127.0.0.5:9"
    assert policy.check("http://localhost:9").url == "http://localhost:9"
    assert policy.check("http://[::1]:9").url == "http://[::1]:9"
    for raw in (
        "http://10.0.0.1:8000",
        "http://gpu01.lab:8000",
        "http://[::ffff:10.0.0.1]:8000",
        "http://[2001:db8::1]:8000",
    ):
        with pytest.raises(EndpointNotAllowed):
            policy.check(raw)


def test_mapped_ipv4_cannot_bypass_ipv4_networks() -> None:
    policy = EndpointPolicy.from_strings(hosts=[], networks=["10.0.0.0/8"], ports=[])
    assert policy.check("http://[::ffff:10.1.2.3]:8000").url == "http://10.1.2.3:8000"
    with pytest.raises(EndpointNotAllowed):
        policy.check("http://[::ffff:192.168.1.1]:8000")


def test_suffix_patterns_and_ports() -> None:
    policy = EndpointPolicy.from_strings(hosts=["*.lab", "exact.example"], networks=[], ports=[8000, 8001])
    assert policy.check("gpu01.lab:8000").host == "gpu01.lab"
    assert policy.check("a.b.lab:8001").host == "a.b.lab"
    assert policy.check("exact.example:8000").host == "exact.example"
    for raw in ("lab:8000", "evil-lab:8000", "gpu01.lab.evil:8000", "sub.exact.example:8000"):
        with pytest.raises(EndpointNotAllowed):
            policy.check(raw)
    with pytest.raises(EndpointNotAllowed) as info:
        policy.check("gpu01.lab:9000")
    assert "allowed ports: 8000, 8001" in info.value.message
