"""The upstream client: what the gateway sends a node, the HTTP client that sends it, and what its failures
become in QIIP's error tree.

The client is this package's own HTTP/1.1 over pooled connections (`_pool`, `_http11`: httptools, chosen for speed,
docs/performance.md). Its exceptions, and those of aiohttp (the health probes' client, whose resolver
`AllowlistResolver` is here), zlib and the OS, never leave this package: `map_transport_error` translates them
with one table, most specific class first, so the forwarder and the response raise `UpstreamError`s only. A test
asserts that every client error class has a row.
"""

from __future__ import annotations

import errno
import socket
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from qiip_core._errors import UpstreamConnectError, UpstreamError, UpstreamTimeout, UpstreamTransportError
from qiip_core.nodes import ApiName, EndpointPolicy
from qiip_core.upstream._http11 import (
    NodeAnswerCut,
    NodeAnswerMalformed,
    NodeConnectError,
    NodeConnectTimeout,
    NodeDisconnected,
    NodeHttpError,
    SendProgress,
)
from qiip_core.upstream._pool import NodeConnections

__all__ = [
    "TRANSPORT_ERRORS",
    "AllowlistResolver",
    "SendProgress",
    "UpstreamClient",
    "UpstreamRequest",
    "is_stale_connection",
    "map_transport_error",
]


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    """One client request, ready to send to any node serving its model.

    Attributes:
        path: the API path, for example `/v1/chat/completions`.
        body: the client's body, forwarded byte for byte.
        headers: headers to forward (already filtered of hop-by-hop and client credentials).
        model: the requested model.
        stream: True when the client asked for SSE (`"stream": true`).
        api: which OpenAI API this is, to route only to nodes that serve it (None: any node of the model).
        prefix: the hashes of its leading blocks (`PrefixAffinity.prefix_of`), for prefix-aware routing;
            empty when its model routes by least-connections.
    """

    path: str
    body: bytes
    headers: Sequence[tuple[str, str]]
    model: str
    stream: bool
    api: ApiName | None = None
    prefix: tuple[int, ...] = ()


class AllowlistResolver(AbstractResolver):
    """aiohttp's threaded resolver, keeping only the addresses the endpoint allowlist lets a host name reach
    (`EndpointPolicy.allows_resolved`): checked when the connection is made, so a name that resolves
    somewhere else later is refused then.

    Args:
        policy: the endpoint allowlist.

    Raises (from `resolve`):
        OSError: the name resolves only to refused addresses (aiohttp reports a connect error).
    """

    def __init__(self, policy: EndpointPolicy) -> None:
        self.policy = policy
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        allowed = [result for result in results if self.policy.allows_resolved(result["host"])]
        if not allowed:
            refused = ", ".join(sorted({result["host"] for result in results}))
            raise OSError(f"{host} resolves only to addresses the endpoint allowlist refuses ({refused})")
        return allowed

    async def close(self) -> None:
        await self._inner.close()


class UpstreamClient(NodeConnections):
    """The HTTP/1.1 client for node traffic: one keep-alive pool for all nodes (`NodeConnections`, whose `post` and
    `aclose` it is).

    Proxy environment variables are ignored (node traffic never goes through a proxy), redirects are never
    followed, and bodies are not decompressed (non-streaming answers are relayed as they come, with their
    `Content-Encoding`). A send on a pooled connection the node had closed raises `NodeDisconnected`; the forwarder
    sends it once more with `fresh=True` (`is_stale_connection`): a node that closes after each streamed answer
    while advertising keep-alive, as llama-server does, may have closed the other pooled connections too.

    Args:
        settings: pool size, idle connections kept and their expiry (keep it below the nodes' idle timeout; vLLM's
            is 5 s), connect and pool timeouts.
        policy: the endpoint allowlist the addresses of host names are checked against when connecting; None checks
            nothing.
    """


# Most specific first: the first matching class decides. A test asserts that every aiohttp client error
# class is matched by some row.
_TRANSPORT_ERRORS: tuple[tuple[type[BaseException], type[UpstreamError], str], ...] = (
    (NodeConnectTimeout, UpstreamTimeout, "connecting to the node timed out"),
    (NodeConnectError, UpstreamConnectError, "the node refused or dropped the connection"),
    (NodeDisconnected, UpstreamTransportError, "the node closed the connection"),
    (NodeAnswerCut, UpstreamTransportError, "the node's response was cut short or malformed"),
    (NodeAnswerMalformed, UpstreamTransportError, "the node's response could not be parsed"),
    (NodeHttpError, UpstreamTransportError, "the connection to the node failed"),
    (aiohttp.ConnectionTimeoutError, UpstreamTimeout, "connecting to the node timed out"),
    (aiohttp.SocketTimeoutError, UpstreamTimeout, "the node stopped sending"),
    (aiohttp.ServerTimeoutError, UpstreamTimeout, "the node timed out"),
    (aiohttp.ClientConnectorError, UpstreamConnectError, "the node refused or dropped the connection"),
    (aiohttp.ServerFingerprintMismatch, UpstreamConnectError, "the node's TLS certificate did not match its pin"),
    (aiohttp.ServerDisconnectedError, UpstreamTransportError, "the node closed the connection"),
    (aiohttp.ClientPayloadError, UpstreamTransportError, "the node's response was cut short or malformed"),
    (aiohttp.ClientResponseError, UpstreamTransportError, "the node's response could not be parsed"),
    (aiohttp.ClientOSError, UpstreamTransportError, "the connection to the node failed"),
    (aiohttp.ServerConnectionError, UpstreamTransportError, "the connection to the node failed"),
    (aiohttp.ClientConnectionError, UpstreamTransportError, "the connection to the node failed"),
    (aiohttp.InvalidURL, UpstreamTransportError, "the node's URL is invalid"),
    (aiohttp.NonHttpUrlClientError, UpstreamTransportError, "the node's URL is not HTTP"),
    (aiohttp.RedirectClientError, UpstreamTransportError, "the node answered with a redirect that cannot be used"),
    (
        aiohttp.client_exceptions.UploadAbortedError,
        UpstreamTransportError,
        "sending the request to the node was aborted",
    ),
    (aiohttp.ClientError, UpstreamTransportError, "the connection to the node failed"),
    (zlib.error, UpstreamTransportError, "the node's compressed response could not be decoded"),
    (TimeoutError, UpstreamTimeout, "the node timed out"),
    (OSError, UpstreamTransportError, "the connection to the node failed"),
)

TRANSPORT_ERRORS = (NodeHttpError, aiohttp.ClientError, zlib.error, TimeoutError, OSError)
"""Exceptions `map_transport_error` translates."""


def map_transport_error(exc: BaseException, node_id: str | None) -> UpstreamError:
    """Translate a client library error into QIIP's tree (most specific class wins).

    Args:
        exc: the aiohttp, zlib or OS error.
        node_id: the node the request went to.

    Returns:
        `UpstreamTimeout` (504), `UpstreamConnectError` (502) or `UpstreamTransportError` (502).
    """
    for library_type, ours, text in _TRANSPORT_ERRORS:
        if isinstance(exc, library_type):
            # The library's words name addresses and may quote the node: they are the error's `detail`, for
            # logs and the admin API; the client gets `text`.
            error = ours(f"{text}.", node_id=node_id, detail=describe_client_error(exc))
            error.local = is_local_exhaustion(exc)
            return error
    return UpstreamTransportError("the connection to the node failed.", node_id=node_id, detail=repr(exc))


def describe_client_error(exc: BaseException) -> str:
    """What a client library error says, with the OS error behind a failed connect (aiohttp's message alone
    drops it: `Cannot connect to host h:p ssl:default [None]`); `timed out` for a deadline that says nothing
    (asyncio's and aiohttp's total timeouts are a bare `TimeoutError`)."""
    if isinstance(exc, TimeoutError) and not str(exc):
        return "timed out"
    text = str(exc) or type(exc).__name__
    cause = getattr(exc, "os_error", None)
    if isinstance(exc, aiohttp.ClientConnectorError) and cause is not None and str(cause) not in text:
        text = f"{text}: {cause}"
    return text


_LOCAL_EXHAUSTION = frozenset({errno.EMFILE, errno.ENFILE})
"""Errors that are this process's (or machine's) lack of file descriptors, never a node's fault."""


def is_local_exhaustion(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is the gateway running out of file descriptors (`EMFILE`, `ENFILE`):
    a failure no node should be blamed for."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _LOCAL_EXHAUSTION:
            return True
        cause = getattr(current, "os_error", None)
        if isinstance(cause, OSError) and cause.errno in _LOCAL_EXHAUSTION:
            return True
        current = current.__cause__ or current.__context__
    return False


_NOT_STALE = (
    NodeConnectError,  # the connect itself failed
    aiohttp.ClientConnectorError,  # the connect itself failed: the node is down or refusing, not a stale pool entry
    aiohttp.ServerFingerprintMismatch,  # the node's TLS certificate is wrong on every connection
    TimeoutError,  # aiohttp's timeouts (ServerTimeoutError, …) are timeouts, with their own rules
)
_STALE = (NodeDisconnected, aiohttp.ClientConnectionError, ConnectionResetError, BrokenPipeError)


def is_stale_connection(exc: BaseException) -> bool:
    """Whether a send failed before any response byte the way a connection the node had already closed fails.

    A node that closes its keep-alive connections (llama-server after each streamed answer, while its answer said
    `Keep-Alive`) races the pool: the connection handed out may be closing as the request is written. The node
    client then raises `NodeDisconnected` (the close came first, or while the request was written); aiohttp, the
    client before it, raised one of several `ClientConnectionError`s: `ServerDisconnectedError`, `ClientOSError` (a
    reset while writing), `ClientConnectionResetError` ("Cannot write to closing transport"), or a plain
    `ClientConnectionError` ("Failed to send bytes into the underlying connection"). Each is worth one try on a new
    connection to the same node, counted against nothing; a failed connect, a TLS pin mismatch or a timeout is
    not.

    Args:
        exc: what `UpstreamClient.post` raised.

    Returns:
        True for a broken or closing connection, False for anything else.
    """
    return isinstance(exc, _STALE) and not isinstance(exc, _NOT_STALE)
