"""A host name that passes the endpoint allowlist but resolves to an address no network allows (loopback,
link-local, the metadata service) gets no node traffic: the resolver is checked when connecting."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from qiip_core.nodes import EndpointPolicy
from tests.support.daemon import Daemon, wait_until
from tests.support.fault_backend import FaultBackend

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def lab_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose nodes are `localhost` by name, but whose only allowed network is 10.20.0.0/16."""
    env = {
        "QIIP_ROUTING__ALLOWED_ENDPOINT_HOSTS": '["localhost"]',
        "QIIP_ROUTING__ALLOWED_ENDPOINT_NETWORKS": '["10.20.0.0/16"]',
    }
    with Daemon(tmp_path_factory.mktemp("lab-daemon"), env=env) as daemon:
        yield daemon


def test_a_name_that_resolves_to_loopback_gets_nothing(
    lab_daemon: Daemon, backends: Callable[..., FaultBackend], model: str
) -> None:
    backend = backends()
    port = backend.url.rsplit(":", 1)[1]
    lab_daemon.add_node(f"{model}-n", f"http://localhost:{port}", model, wait=False)
    wait_until(
        lambda: "resolves only to addresses the endpoint allowlist refuses" in lab_daemon.log(), what="a refusal"
    )
    answer = httpx.post(lab_daemon.url + "/v1/chat/completions", json={"model": model, "messages": []}, timeout=30)
    assert answer.status_code in (502, 503)
    assert backend.requests == []  # neither a probe nor a request reached it


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("10.20.3.4", True),  # an allowed network
        ("192.168.1.10", True),  # private, not special
        ("127.0.0.1", False),
        ("::1", False),
        ("::ffff:127.0.0.1", False),
        ("169.254.169.254", False),  # the metadata service
        ("fe80::1%eth0", False),
        ("0.0.0.0", False),
        ("not an address", False),
    ],
)
def test_which_resolved_addresses_a_host_name_may_reach(address: str, allowed: bool) -> None:
    policy = EndpointPolicy.from_strings(hosts=["*.lab.example.com"], networks=["10.20.0.0/16"], ports=[])
    assert policy.allows_resolved(address) is allowed


def test_a_network_can_allow_loopback() -> None:
    policy = EndpointPolicy.from_strings(hosts=["localhost"], networks=["127.0.0.0/8"], ports=[])
    assert policy.allows_resolved("127.0.0.1")
