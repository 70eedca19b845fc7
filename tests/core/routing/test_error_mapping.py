from __future__ import annotations

import httpx
import pytest

from qiip_core import UpstreamConnectError, UpstreamError, UpstreamTimeout, UpstreamTransportError
from qiip_core.routing import map_transport_error


def _subclasses(cls: type) -> set[type]:
    found: set[type] = set()
    sub: type
    for sub in cls.__subclasses__():
        found.add(sub)
        found |= _subclasses(sub)
    return found


@pytest.mark.parametrize("exc_type", sorted(_subclasses(httpx.TransportError) | {httpx.DecodingError}, key=str))
def test_every_httpx_transport_error_is_mapped(exc_type: type[httpx.TransportError]) -> None:
    mapped = map_transport_error(exc_type("boom"), "n1")
    assert isinstance(mapped, UpstreamError)
    assert mapped.node_id == "n1" and mapped.retryable
    assert "boom" in mapped.message


@pytest.mark.parametrize(
    ("exc", "ours", "status", "code"),
    [
        (httpx.ConnectError("x"), UpstreamConnectError, 502, "backend_unavailable"),
        (httpx.ConnectTimeout("x"), UpstreamTimeout, 504, "backend_timeout"),
        (httpx.ReadTimeout("x"), UpstreamTimeout, 504, "backend_timeout"),
        (httpx.PoolTimeout("x"), UpstreamTimeout, 504, "backend_timeout"),
        (httpx.RemoteProtocolError("x"), UpstreamTransportError, 502, "backend_transport_error"),
        (httpx.ReadError("x"), UpstreamTransportError, 502, "backend_transport_error"),
    ],
)
def test_most_specific_mapping_wins(exc: httpx.TransportError, ours: type, status: int, code: str) -> None:
    mapped = map_transport_error(exc, None)
    assert type(mapped) is ours and mapped.status == status and mapped.code == code
