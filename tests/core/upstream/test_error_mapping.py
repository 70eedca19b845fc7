from __future__ import annotations

import aiohttp
import pytest

from qiip_core import UpstreamError, UpstreamTimeout, UpstreamTransportError
from qiip_core.upstream import is_stale_connection, map_transport_error
from qiip_core.upstream._client import _TRANSPORT_ERRORS
from qiip_core.upstream._http11 import NodeHttpError


def _subclasses(cls: type) -> set[type]:
    found: set[type] = set()
    sub: type
    for sub in cls.__subclasses__():
        found.add(sub)
        found |= _subclasses(sub)
    return found


AIOHTTP_ERRORS = sorted(
    (c for c in _subclasses(aiohttp.ClientError) if c.__module__.startswith("aiohttp")), key=lambda c: c.__name__
)


@pytest.mark.parametrize("exc_type", AIOHTTP_ERRORS, ids=lambda c: c.__name__)
def test_every_aiohttp_client_error_has_a_specific_row(exc_type: type) -> None:
    rows = [library for library, _, _ in _TRANSPORT_ERRORS]
    assert any(issubclass(exc_type, row) for row in rows if row is not aiohttp.ClientError), exc_type


@pytest.mark.parametrize(
    ("exc", "ours", "status", "code"),
    [
        (aiohttp.ConnectionTimeoutError("x"), UpstreamTimeout, 504, "backend_timeout"),
        (aiohttp.SocketTimeoutError("x"), UpstreamTimeout, 504, "backend_timeout"),
        (aiohttp.ServerDisconnectedError(), UpstreamTransportError, 502, "backend_transport_error"),
        (aiohttp.ClientPayloadError("x"), UpstreamTransportError, 502, "backend_transport_error"),
        (aiohttp.ClientOSError(104, "reset"), UpstreamTransportError, 502, "backend_transport_error"),
        (TimeoutError(), UpstreamTimeout, 504, "backend_timeout"),
        (ConnectionResetError(), UpstreamTransportError, 502, "backend_transport_error"),
    ],
)
def test_most_specific_mapping_wins(exc: BaseException, ours: type, status: int, code: str) -> None:
    mapped = map_transport_error(exc, "n1")
    assert type(mapped) is ours and mapped.status == status and mapped.code == code
    assert isinstance(mapped, UpstreamError) and mapped.node_id == "n1" and mapped.retryable


STALE = {
    aiohttp.ClientConnectionError,
    aiohttp.ClientConnectionResetError,
    aiohttp.ClientOSError,
    aiohttp.ServerConnectionError,
    aiohttp.ServerDisconnectedError,
}
"""The aiohttp errors of a request on a connection the node closed (or was closing): sent again on a new one."""


@pytest.mark.parametrize("exc_type", AIOHTTP_ERRORS, ids=lambda c: c.__name__)
def test_every_aiohttp_client_error_is_classed_stale_connection_or_not(exc_type: type[BaseException]) -> None:
    # A new aiohttp error class lands here: decide whether it is a closing connection (retried once on a new
    # one, never counted) and list it in STALE if so.
    assert is_stale_connection(exc_type.__new__(exc_type)) == (exc_type in STALE), exc_type


def test_reset_and_broken_pipe_are_stale_and_timeouts_are_not() -> None:
    assert is_stale_connection(ConnectionResetError()) and is_stale_connection(BrokenPipeError())
    assert not is_stale_connection(TimeoutError()) and not is_stale_connection(OSError(24, "Too many open files"))


NODE_CLIENT_ERRORS = sorted(_subclasses(NodeHttpError), key=lambda c: c.__name__)


@pytest.mark.parametrize("exc_type", NODE_CLIENT_ERRORS, ids=lambda c: c.__name__)
def test_every_node_client_error_has_a_specific_row(exc_type: type) -> None:
    rows = [library for library, _, _ in _TRANSPORT_ERRORS]
    assert any(issubclass(exc_type, row) for row in rows if row is not NodeHttpError), exc_type
