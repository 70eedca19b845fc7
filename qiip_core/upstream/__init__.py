"""Sending to the nodes: the HTTP client, the request it sends and its errors translated, and the node's answer as
the relay reads it (SSE framing included).

`_client` (`UpstreamClient`: one pool of HTTP/1.1 connections over the nodes, `_pool` and `_http11`;
`AllowlistResolver` for the health probes' aiohttp; transport errors mapped to the error tree), `_response`
(`UpstreamResponse`: the committed answer, read to its end; it reports the node's outcome to an `OutcomeSink`, which
the routing table's reservation implements; what it reads of the answer before that is `_answer`), `_sse` (event
framing).

Deciding where a request goes is `qiip_core.routing`'s: it imports this package, never the other way round.
"""

from __future__ import annotations

from qiip_core.upstream._answer import HOP_BY_HOP_HEADERS, node_error_reason
from qiip_core.upstream._client import (
    AllowlistResolver,
    UpstreamClient,
    UpstreamRequest,
    describe_client_error,
    is_local_exhaustion,
    is_stale_connection,
    map_transport_error,
)
from qiip_core.upstream._response import OutcomeSink, UpstreamResponse
from qiip_core.upstream._sse import EventFramer, event_boundary

__all__ = [
    "HOP_BY_HOP_HEADERS",
    "AllowlistResolver",
    "EventFramer",
    "OutcomeSink",
    "UpstreamClient",
    "UpstreamRequest",
    "UpstreamResponse",
    "describe_client_error",
    "event_boundary",
    "is_local_exhaustion",
    "is_stale_connection",
    "map_transport_error",
    "node_error_reason",
]
