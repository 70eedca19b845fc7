"""No work before authentication: admin credentials and body sizes are checked from the headers, invoke tokens
before the body is read, and an address that keeps failing is throttled, logged and counted."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.support.daemon import Daemon, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    env = {
        "QIIP_ADMIN__AUTH_FAILURE_BURST": "5",
        "QIIP_ADMIN__AUTH_FAILURE_WINDOW_S": "6",
        "QIIP_ADMIN__MAX_BODY_BYTES": "4096",
        "QIIP_AUTH__CLIENT_TOKENS": "required",
    }
    with Daemon(tmp_path_factory.mktemp("gated"), env=env) as daemon:
        yield daemon


def test_a_large_body_without_credentials_is_refused_before_it_is_read(gated: Daemon) -> None:
    # 64 MiB declared, nothing sent: an answer that comes at once was given from the headers alone.
    with socket.create_connection(("127.0.0.1", int(gated.url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(
            b"POST /admin/nodes HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 67108864\r\n\r\n"
        )
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 401")


def test_admin_bodies_are_capped_before_they_are_read(gated: Daemon) -> None:
    big = {"id": "x" * 5000, "endpoint": "http://127.0.0.1:1", "model": "m"}
    answer = gated.admin.post("/admin/nodes", json=big)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"
    chunked = gated.admin.post(
        "/admin/nodes", content=iter([b'{"id": "a"}']), headers={"content-type": "application/json"}
    )
    assert chunked.status_code == 411


def from_address(daemon: Daemon, address: str) -> httpx.Client:
    """A client whose connections come from `address` (in 127.0.0.0/8): an address of its own is a fresh window."""
    transport = httpx.HTTPTransport(local_address=address)
    return httpx.Client(base_url=daemon.url, transport=transport, trust_env=False, timeout=10)


def test_failed_authentications_are_throttled_logged_and_counted(gated: Daemon) -> None:
    with from_address(gated, "127.0.0.21") as client:
        answers = [client.get("/admin/nodes", auth=("admin", f"guess-{i}")) for i in range(7)]
        answers.append(client.get("/admin/nodes"))
        statuses = [answer.status_code for answer in answers]
        assert statuses[:5] == [401] * 5 and set(statuses[5:]) == {429}
        # Credentials that were sent are called wrong, not missing.
        assert "refused: wrong username or password" in answers[0].json()["error"]["message"]
        throttled = client.get("/admin/nodes", auth=("admin", "test-password"))
        assert throttled.status_code == 429 and 1 <= int(throttled.headers["retry-after"]) <= 6
        log = gated.log()
        assert log.count("admin authentication failed from 127.0.0.21") >= 5 and "guess-" not in log
        assert gated.counter("qiip_auth_failures_total", api="admin") >= 5
        # Other addresses are not throttled.
        assert gated.admin.get("/admin/nodes").status_code == 200
        # Once the window has passed, the address is served again.
        wait_until(
            lambda: client.get("/admin/nodes", auth=("admin", "test-password")).status_code == 200,
            what="the throttling window to pass",
        )
        missing = client.get("/admin/nodes")
        assert missing.status_code == 401 and "credentials are required" in missing.json()["error"]["message"]


def test_an_unknown_invoke_token_is_refused_before_the_body_and_counted(gated: Daemon) -> None:
    secret = "qiip_" + "x" * 40
    answer = httpx.post(
        gated.url + "/v1/chat/completions",
        content=b"{" * 100_000,  # never parsed: the token is checked first
        headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json"},
        timeout=10,
    )
    assert answer.status_code == 401
    assert secret not in gated.log() and "invoke token refused from 127.0.0.1" in gated.log()
    assert gated.counter("qiip_auth_failures_total", api="client") >= 1
