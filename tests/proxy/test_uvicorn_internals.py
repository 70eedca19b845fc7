"""The parts of uvicorn the daemon's HTTP server subclasses and reads (`qiip_proxy/server/`: `_transport`,
`_connection_cap`, `_server`) are still there with the same shapes: an upgrade that renames a method, changes a
signature or drops an attribute fails here, before the limits silently stop working. pyproject.toml pins uvicorn
to the series these were read from."""

from __future__ import annotations

import asyncio
import inspect
from collections import deque
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

PROTOCOL_METHODS = {
    "connection_made": ["self", "transport"],
    "connection_lost": ["self", "exc"],
    "data_received": ["self", "data"],
    "on_message_begin": ["self"],
    "on_url": ["self", "url"],
    "on_header": ["self", "name", "value"],
    "on_headers_complete": ["self"],
    "on_body": ["self", "body"],
    "on_message_complete": ["self"],
    "on_response_complete": ["self"],
}
"""The protocol methods `GuardedProtocol` and the connection cap override, with their parameters."""

DIRECT_PATH_METHODS = {
    "_start_asgi_task": ["self", "cycle", "app"],
    "on_response_complete": ["self"],
    "shutdown": ["self"],
}
"""The protocol methods the direct path (`_fast`) calls, or whose calls on its cycle it answers, with their
parameters."""

SERVER_METHODS = {
    "__init__": ["self", "config"],
    "startup": ["self", "sockets"],
    "shutdown": ["self", "sockets"],
    "handle_exit": ["self", "sig", "frame"],
}
"""The `uvicorn.Server` methods `Server` overrides, with their parameters."""


def test_the_protocol_methods_we_override_keep_their_names_and_parameters() -> None:
    for name, parameters in PROTOCOL_METHODS.items():
        assert list(inspect.signature(getattr(HttpToolsProtocol, name)).parameters) == parameters, name


def test_the_protocol_methods_the_direct_path_calls_keep_their_names_and_parameters() -> None:
    for name, parameters in DIRECT_PATH_METHODS.items():
        assert list(inspect.signature(getattr(HttpToolsProtocol, name)).parameters) == parameters, name


def test_the_server_methods_we_override_keep_their_names_and_parameters() -> None:
    for name, parameters in SERVER_METHODS.items():
        assert list(inspect.signature(getattr(uvicorn.Server, name)).parameters) == parameters, name


async def test_a_connection_has_the_attributes_our_limits_read() -> None:
    protocols: list[HttpToolsProtocol] = []
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        protocol = protocols[0]
        cycle: Any = protocol.cycle
        seen.update(
            url=protocol.url,
            expect_100_continue=protocol.expect_100_continue,
            root_path=protocol.root_path,
            limit_concurrency=protocol.limit_concurrency,
            scope=protocol.scope,
            client=protocol.client,
            loop=protocol.loop,
            in_connections=protocol in state.connections,
            pipeline=protocol.pipeline,
            cycle_flags=(cycle.response_started, cycle.response_complete, cycle.disconnected, cycle.more_body),
            message_event=cycle.message_event,
        )
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    config = uvicorn.Config(app, http="httptools", lifespan="off", log_config=None)
    config.load()
    state = ServerState()
    loop = asyncio.get_running_loop()

    def factory() -> HttpToolsProtocol:
        protocol = HttpToolsProtocol(config=config, server_state=state, app_state={}, _loop=loop)
        protocols.append(protocol)
        return protocol

    server = await loop.create_server(factory, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET / HTTP/1.1\r\nhost: test\r\n\r\n")
        answer = await reader.readuntil(b"ok")
    finally:
        writer.close()
        server.close()
        await server.wait_closed()

    assert answer.startswith(b"HTTP/1.1 200 ")
    assert seen["client"][0] == "127.0.0.1"
    # What the direct path (`_fast`) reads when a request's headers are in, and writes into the scope.
    assert seen["url"] == b"/" and seen["expect_100_continue"] is False and seen["root_path"] == ""
    assert seen["limit_concurrency"] is None and seen["scope"]["method"] == "GET"
    assert seen["loop"] is loop
    assert seen["in_connections"]
    assert isinstance(seen["pipeline"], deque)
    assert seen["cycle_flags"] == (False, False, False, False)
    assert isinstance(seen["message_event"], asyncio.Event)
    protocol = protocols[0]
    assert isinstance(protocol.transport, asyncio.Transport)
    assert all(isinstance(name, bytes) and isinstance(value, bytes) for name, value in state.default_headers)
