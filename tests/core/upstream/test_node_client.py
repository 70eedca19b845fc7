"""The node client's HTTP/1.1 (`_pool`, `_http11`) against a scripted node on loopback: every answer's framing, the
pool's reuse and bounds, and each way a connection fails, as the error the forwarder and the response act on."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import trustme

from qiip_core import UpstreamConnectError, UpstreamTimeout, UpstreamTransportError
from qiip_core.config import UpstreamSettings
from qiip_core.nodes import EndpointPolicy
from qiip_core.upstream import is_stale_connection, map_transport_error
from qiip_core.upstream._http11 import (
    HIGH_WATER_BYTES,
    NodeAnswerCut,
    NodeAnswerMalformed,
    NodeConnectError,
    NodeConnectTimeout,
    NodeDisconnected,
    NodeHttpError,
    SendProgress,
)
from qiip_core.upstream._pool import NodeConnections

Answer = bytes | Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
"""What the node does with one request: write these bytes (and keep the connection), or run this."""


def ok(body: bytes, *extra: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % len(body)
    return head + b"".join(extra) + b"\r\n" + body


@dataclass
class ScriptedNode:
    """A node that answers each request with the next scripted answer, and records what it got."""

    answers: list[Answer] = field(default_factory=list)
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    closed: int = 0
    port: int = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                if isinstance(answer, bytes):
                    writer.write(answer)
                    await writer.drain()
                else:
                    await answer(reader, writer)
                    if writer.is_closing():
                        return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            writer.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
async def node() -> AsyncIterator[ScriptedNode]:
    scripted = ScriptedNode()
    server = await asyncio.start_server(scripted.serve, "127.0.0.1", 0)
    scripted.port = server.sockets[0].getsockname()[1]
    async with server:
        yield scripted
        server.close()


@pytest.fixture
async def pool() -> AsyncIterator[NodeConnections]:
    connections = NodeConnections(UpstreamSettings())
    yield connections
    await connections.aclose()


async def read_all(pool: NodeConnections, url: str, **kwargs: object) -> tuple[int, bytes]:
    response = await pool.post(url + "/v1/chat/completions", b'{"model": "m"}', [("x-request-id", "r1")], **kwargs)  # type: ignore[arg-type]
    body = b""
    while chunk := await response.readany():
        body += chunk
    response.release()
    return response.status, body


async def test_answers_of_every_framing_are_read_whole_and_keep_alive_reuses_one_connection(
    node: ScriptedNode, pool: NodeConnections
) -> None:
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    node.answers += [ok(b'{"a": 1}'), chunked, ok(b"")]
    assert await read_all(pool, node.url) == (200, b'{"a": 1}')
    assert await read_all(pool, node.url) == (200, b"hello world")
    assert await read_all(pool, node.url) == (200, b"")
    assert node.connections == 1
    first = node.requests[0]
    assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:%d\r\n" % node.port in first and b"\r\nContent-Length: 14\r\n" in first
    assert b"\r\nx-request-id: r1\r\n" in first and b"\r\nAccept: */*\r\n" in first
    assert first.endswith(b'\r\n\r\n{"model": "m"}')


async def test_a_body_without_a_length_ends_with_the_connection(node: ScriptedNode, pool: NodeConnections) -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"whole": ')
        await writer.drain()
        writer.write(b"true}")
        writer.close()

    node.answers += [until_close, ok(b"next")]
    assert await read_all(pool, node.url) == (200, b'{"whole": true}')
    assert await read_all(pool, node.url) == (200, b"next")
    assert node.connections == 2


async def test_headers_are_read_as_sent_and_looked_up_by_their_lower_case_name(
    node: ScriptedNode, pool: NodeConnections
) -> None:
    node.answers.append(
        b"HTTP/1.1 200 OK\r\nContent-Type: Text/Event-Stream; charset=utf-8\r\nX-Two: 1\r\nX-Two: 2\r\n"
        b"Content-Length: 0\r\n\r\n"
    )
    response = await pool.post(node.url + "/v1/completions", b"{}", [])
    assert response.content_type == "text/event-stream"
    assert response.header("x-two") == "1" and response.header("X-TWO") is None
    assert (b"X-Two", b"2") in response.raw_headers
    assert await response.readany() == b"" and response.at_eof()


async def test_an_informational_answer_is_skipped(node: ScriptedNode, pool: NodeConnections) -> None:
    node.answers.append(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"after"))
    assert await read_all(pool, node.url) == (200, b"after")


async def test_a_connection_the_node_closes_after_its_answer_is_not_reused(
    node: ScriptedNode, pool: NodeConnections
) -> None:
    node.answers += [ok(b"1", b"connection: close\r\n"), ok(b"2")]
    assert await read_all(pool, node.url) == (200, b"1")
    assert await read_all(pool, node.url) == (200, b"2")
    assert node.connections == 2


async def test_a_fresh_connection_says_close_and_stays_out_of_the_pool(
    node: ScriptedNode, pool: NodeConnections
) -> None:
    node.answers += [ok(b"1"), ok(b"2")]
    assert await read_all(pool, node.url, fresh=True) == (200, b"1")
    assert b"\r\nConnection: close\r\n" in node.requests[0]
    assert await read_all(pool, node.url) == (200, b"2")
    assert node.connections == 2


async def test_a_close_before_the_headers_is_a_stale_connection(node: ScriptedNode, pool: NodeConnections) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    node.answers.append(hang_up)
    progress = SendProgress()
    with pytest.raises(NodeDisconnected) as closed:
        await pool.post(node.url + "/v1/completions", b"{}", [], progress)
    assert progress.sent and is_stale_connection(closed.value)
    mapped = map_transport_error(closed.value, "n1")
    assert isinstance(mapped, UpstreamTransportError) and mapped.message == "the node closed the connection."


async def test_a_body_cut_short_raises_after_the_bytes_before_the_cut(
    node: ScriptedNode, pool: NodeConnections
) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart")
        await writer.drain()
        writer.close()

    node.answers.append(cut)
    response = await pool.post(node.url + "/v1/completions", b"{}", [])
    received = b""
    with pytest.raises(NodeAnswerCut) as broken:
        while chunk := await response.readany():
            received += chunk
    assert received == b"part" and not is_stale_connection(broken.value)
    assert map_transport_error(broken.value, "n1").message == "the node's response was cut short or malformed."


async def test_bytes_that_are_not_http_are_refused(node: ScriptedNode, pool: NodeConnections) -> None:
    node.answers.append(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
    with pytest.raises(NodeAnswerMalformed) as malformed:
        await pool.post(node.url + "/v1/completions", b"{}", [])
    assert not is_stale_connection(malformed.value)


async def test_an_abandoned_answer_closes_its_connection(node: ScriptedNode, pool: NodeConnections) -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await reader.read()  # until the client closes
        writer.close()

    node.answers.append(slow)
    response = await pool.post(node.url + "/v1/completions", b"{}", [])
    assert await response.readany() == b"first"
    response.close()
    for _ in range(200):
        if node.closed:
            break
        await asyncio.sleep(0.01)
    assert node.closed == 1


async def test_a_large_body_is_read_whole_across_the_reading_pause(node: ScriptedNode, pool: NodeConnections) -> None:
    big = bytes(range(256)) * (4 * HIGH_WATER_BYTES // 256)
    node.answers += [ok(big), ok(b"after")]
    response = await pool.post(node.url + "/v1/completions", b"{}", [])
    await asyncio.sleep(0.2)  # the whole body arrives while nobody reads: the connection pauses
    body = b""
    while chunk := await response.readany():
        body += chunk
    assert body == big
    assert await read_all(pool, node.url) == (200, b"after") and node.connections == 1


async def test_a_refused_connect_is_a_connect_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pool = NodeConnections(UpstreamSettings())
    try:
        with pytest.raises(NodeConnectError) as refused:
            await pool.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", [])
        assert not is_stale_connection(refused.value) and isinstance(refused.value.__cause__, OSError)
        assert isinstance(map_transport_error(refused.value, "n1"), UpstreamConnectError)
    finally:
        await pool.aclose()


async def test_a_name_resolving_only_to_refused_addresses_gets_no_connection(node: ScriptedNode) -> None:
    policy = EndpointPolicy.from_strings(hosts=["localhost"], networks=["10.20.0.0/16"], ports=[])
    pool = NodeConnections(UpstreamSettings(), policy=policy)
    try:
        with pytest.raises(NodeConnectError, match="resolves only to addresses the endpoint allowlist refuses"):
            await pool.post(f"http://localhost:{node.port}/v1/completions", b"{}", [])
        assert node.connections == 0
    finally:
        await pool.aclose()


async def test_at_the_connection_limit_a_request_waits_for_one_and_then_times_out(node: ScriptedNode) -> None:
    async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client closes
        writer.close()

    node.answers += [held, ok(b"second")]
    settings = UpstreamSettings(max_connections=1, pool_timeout_s=0.2, connect_timeout_s=0.1)
    pool = NodeConnections(settings)
    try:
        first = await pool.post(node.url + "/v1/completions", b"{}", [])
        with pytest.raises(NodeConnectTimeout) as waited:
            await pool.post(node.url + "/v1/completions", b"{}", [])
        assert isinstance(map_transport_error(waited.value, "n1"), UpstreamTimeout)
        # Once the first answer is abandoned, its slot is free for the next request.
        second = asyncio.ensure_future(read_all(pool, node.url))
        await asyncio.sleep(0.05)
        first.close()
        assert await second == (200, b"second")
    finally:
        await pool.aclose()


async def test_an_idle_connection_past_its_expiry_is_not_reused(node: ScriptedNode) -> None:
    pool = NodeConnections(UpstreamSettings(keepalive_expiry_s=0.1))
    try:
        node.answers += [ok(b"1"), ok(b"2")]
        assert await read_all(pool, node.url) == (200, b"1")
        await asyncio.sleep(0.25)
        assert await read_all(pool, node.url) == (200, b"2")
        assert node.connections == 2 and node.closed == 1
    finally:
        await pool.aclose()


@pytest.mark.parametrize(
    "headers", [[("x-evil", "a\r\nx-injected: 1")], [("x-evil", "a\nb")], [("x-evil", "a\rb")], [("x\r\ny", "v")]]
)
async def test_a_header_that_would_end_its_line_is_never_sent(
    node: ScriptedNode, pool: NodeConnections, headers: list[tuple[str, str]]
) -> None:
    with pytest.raises(ValueError, match="line break"):
        await pool.post(node.url + "/v1/completions", b"{}", headers)
    assert node.requests == []


async def test_an_https_node_is_verified_against_the_trusted_authorities() -> None:
    ca = trustme.CA()
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1").configure_cert(served)
    scripted = ScriptedNode(answers=[ok(b"secure")])
    server = await asyncio.start_server(scripted.serve, "127.0.0.1", 0, ssl=served)
    port = server.sockets[0].getsockname()[1]
    async with server:
        untrusting = NodeConnections(UpstreamSettings())
        trusted = ssl.create_default_context()
        ca.configure_trust(trusted)
        trusting = NodeConnections(UpstreamSettings(), tls=trusted)
        try:
            with pytest.raises(NodeConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await untrusting.post(f"https://127.0.0.1:{port}/v1/completions", b"{}", [])
            assert await read_all(trusting, f"https://127.0.0.1:{port}") == (200, b"secure")
            assert b"\r\nHost: 127.0.0.1:%d\r\n" % port in scripted.requests[0]
        finally:
            await untrusting.aclose()
            await trusting.aclose()
        server.close()


def test_every_node_client_error_is_classed_stale_or_not() -> None:
    stale = {NodeDisconnected}
    for error in (NodeHttpError, NodeConnectError, NodeConnectTimeout, NodeDisconnected, NodeAnswerMalformed):
        assert is_stale_connection(error("x")) == (error in stale), error
    assert is_stale_connection(NodeAnswerCut("x")) is False
