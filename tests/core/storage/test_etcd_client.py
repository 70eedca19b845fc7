"""`EtcdClient`: etcd3gw's errors translated at the boundary, and one retry with a fresh token when etcd rejects it.

The unit tests drive `EtcdClient.call` with calls that raise what etcd3gw raises (etcd's JSON error bodies are
the ones a real etcd 3.4 answers); the integration test invalidates a real token by switching etcd
authentication off and on.
"""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import etcd3gw
import pytest
import requests

from qiip_core import RegistryUnavailable
from qiip_core.config import EtcdSettings
from qiip_core.storage import EtcdClient
from qiip_core.storage._etcd import _etcd_errors, _TokenRejected, _translate, _Unreachable
from tests.support.etcd import EtcdServer


def etcd_error(code: int, message: str, reason: str) -> etcd3gw.exceptions.Etcd3Exception:
    """What etcd3gw raises for an HTTP error etcd answers with a gRPC status body."""
    body = json.dumps({"error": message, "message": message, "code": code})
    return etcd3gw.exceptions.Etcd3Exception(body, reason)


def invalid_token() -> etcd3gw.exceptions.Etcd3Exception:
    return etcd_error(16, "etcdserver: invalid auth token", "Unauthorized")


class Calls:
    """A call for `EtcdClient.call` that raises the given exceptions in turn, then answers."""

    def __init__(self, *outcomes: BaseException) -> None:
        self.outcomes = list(outcomes)
        self.count = 0

    def __call__(self, client: Any) -> str:
        self.count += 1
        if self.outcomes:
            raise self.outcomes.pop(0)
        return "answer"


class Client(EtcdClient):
    """A client with credentials whose authentication hands out numbered tokens without a server."""

    def __init__(self, settings: EtcdSettings) -> None:
        super().__init__(settings)
        self.issued: list[str] = []

    def _authenticate(self, client: Any) -> None:
        self.issued.append(f"token-{len(self.issued) + 1}")
        self._token = self.issued[-1]


@pytest.fixture
def client() -> Client:
    settings = EtcdSettings(
        endpoints=["http://127.0.0.1:9", "http://127.0.0.1:10"], username="qiip", password="secret", timeout_s=1
    )
    return Client(settings)


def test_every_etcd3gw_exception_is_mapped() -> None:
    upstream = {
        cls
        for _, cls in inspect.getmembers(etcd3gw.exceptions, inspect.isclass)
        if issubclass(cls, etcd3gw.exceptions.Etcd3Exception)
    }
    table = _etcd_errors()
    assert upstream and upstream <= set(table), upstream - set(table)
    assert all(issubclass(ours, RegistryUnavailable) for ours in table.values())


@pytest.mark.parametrize(
    ("exc", "ours"),
    [
        (etcd3gw.exceptions.ConnectionFailedError("refused"), _Unreachable),
        (etcd3gw.exceptions.ConnectionTimeoutError("timed out"), _Unreachable),
        (requests.ConnectionError("refused"), _Unreachable),  # both a RequestException and an OSError
        (OSError("no such file"), _Unreachable),
        (invalid_token(), _TokenRejected),
        (etcd_error(3, "etcdserver: user name is empty", "Bad Request"), RegistryUnavailable),
        (etcd3gw.exceptions.PreconditionFailedError("{}", "Precondition Failed"), RegistryUnavailable),
        (etcd3gw.exceptions.InternalServerError("not json", "Internal Server Error"), RegistryUnavailable),
    ],
)
def test_the_most_specific_mapping_wins(exc: Exception, ours: type[RegistryUnavailable]) -> None:
    translated = _translate(exc, "http://e:2379")
    assert type(translated) is ours and "http://e:2379" in translated.message


def test_a_rejected_token_is_renewed_once_on_the_same_endpoint(client: Client) -> None:
    call = Calls(invalid_token())
    assert client.call(call) == "answer"
    assert call.count == 2 and client.issued == ["token-1", "token-2"]
    assert client.endpoint == "http://127.0.0.1:9"


def test_the_retry_failure_is_raised_with_its_own_cause(client: Client) -> None:
    refusal = etcd_error(7, "etcdserver: permission denied", "Forbidden")
    with pytest.raises(RegistryUnavailable) as info:
        client.call(Calls(invalid_token(), refusal))
    assert type(info.value) is RegistryUnavailable and info.value.__cause__ is refusal
    assert "refused the request" in info.value.message


def test_a_token_rejected_again_is_not_retried_twice(client: Client) -> None:
    again = invalid_token()
    call = Calls(invalid_token(), again, invalid_token())
    with pytest.raises(RegistryUnavailable) as info:
        client.call(call)
    assert call.count == 2 and info.value.__cause__ is again
    assert type(info.value) is RegistryUnavailable and "rejected the auth token" in info.value.message
    assert "etcdserver: invalid auth token" in info.value.message


def test_a_retry_that_finds_the_endpoint_gone_moves_to_the_next(client: Client) -> None:
    call = Calls(invalid_token(), etcd3gw.exceptions.ConnectionFailedError("connection refused"))
    assert client.call(call) == "answer"
    assert call.count == 3 and client.endpoint == "http://127.0.0.1:10"


def test_unreachable_endpoints_name_the_last_failure(client: Client) -> None:
    first = etcd3gw.exceptions.ConnectionFailedError("first refused")
    last = etcd3gw.exceptions.ConnectionTimeoutError("second timed out")
    with pytest.raises(RegistryUnavailable) as info:
        client.call(Calls(first, last))
    assert info.value.__cause__ is last
    assert info.value.message == (
        "etcd is unreachable at http://127.0.0.1:9, http://127.0.0.1:10 (ConnectionTimeoutError: second timed out)."
    )


def test_a_refusal_is_not_retried_and_other_errors_pass_through(client: Client) -> None:
    refusal = etcd_error(3, "etcdserver: key is not provided", "Bad Request")
    call = Calls(refusal)
    with pytest.raises(RegistryUnavailable) as info:
        client.call(call)
    assert call.count == 1 and info.value.__cause__ is refusal
    assert info.value.message == "etcd at http://127.0.0.1:9 refused the request: Bad Request"
    with pytest.raises(KeyError):
        client.call(Calls(KeyError("header")))


@pytest.mark.integration
def test_a_token_invalidated_by_etcd_is_renewed(etcd: EtcdServer, tmp_path: Path) -> None:
    etcdctl = shutil.which("etcdctl")
    assert etcdctl is not None, "etcdctl (Debian package etcd-client) is needed"

    def ctl(*args: str) -> None:
        subprocess.run(
            [etcdctl, f"--endpoints={etcd.url}", *args], check=True, capture_output=True, env={"ETCDCTL_API": "3"}
        )

    ctl("user", "add", "root:root-password")
    ctl("user", "add", "qiip:qiip-password")
    ctl("role", "add", "qiip")
    ctl("role", "grant-permission", "qiip", "--prefix=true", "readwrite", "/k/")
    ctl("user", "grant-role", "qiip", "qiip")
    ctl("auth", "enable")
    client = EtcdClient(EtcdSettings(endpoints=[etcd.url], username="qiip", password="qiip-password"))
    client.put(b"/k/one", b"1")
    first = client.auth_headers["Authorization"]
    # Switching authentication off and on drops every token etcd issued (as an idle token's TTL does).
    ctl("--user=root:root-password", "auth", "disable")
    ctl("auth", "enable")
    client.put(b"/k/two", b"2")
    assert client.auth_headers["Authorization"] != first
    revision, kvs = client.range_prefix(b"/k/")
    assert revision > 0 and len(kvs) == 2
