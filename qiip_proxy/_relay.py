"""Step 4 of an inference request: relay. Write the node's committed answer to the client as it comes.

The status and headers go first (the request id, `X-QIIP-Node` naming the node that answered, and for a
stream `X-Accel-Buffering: no` and `Cache-Control: no-cache`), then the body: the whole of it when the
forwarder could buffer it, else the first bytes and the rest as `UpstreamResponse.read()` hands it over, whole
SSE events at a time for a stream. The response reports the node's success or failure to the routing table
itself; the relay only writes.

A failure after the first byte is never retried (the client has part of an answer). A stream ends with one
in-band error event and `data: [DONE]`; a plain body cannot say it was cut, so the connection is broken
instead and the client cannot mistake a truncated body for a whole one. A stream stopped from outside (its
invoke token revoked, the daemon stopping) ends the same way, with `end_stream`.

The loop that relays a stream's events is the gateway's hottest path (docs/performance.md): one read and
one send per event, plus what the metrics need: the last two pieces relayed are kept (the node's `usage` is
in them). The time to first token needs nothing per event: a stream is committed by its first data event
(`UpstreamResponse`), so the first token goes out with the first send. Where the server answers the request
itself (`server._fast`), it offers a `BodyWriter`, and the rest of an uncompressed stream is pumped from the node's
connection to the client's as it is parsed (`UpstreamResponse.pump`): whole events still, the same limits and
ends, without waking the request's task per read.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Protocol

from starlette.types import Send

from qiip_core import UpstreamError
from qiip_core.upstream import UpstreamResponse
from qiip_proxy._errors import SSE_DONE, error_body, sse_error_event

if TYPE_CHECKING:
    from qiip_proxy._metrics import Outcome

__all__ = ["SHUTDOWN_EVENT", "BodyWriter", "end_stream", "relay"]

logger = logging.getLogger("qiip.proxy")

SHUTDOWN_EVENT = (
    b"data: "
    + error_body(
        "The gateway is shutting down and ended this stream; retry the request.",
        type="service_unavailable_error",
        code="gateway_shutdown",
    )
    + b"\n\n"
)
"""The in-band error event of a stream the daemon ended because it is stopping."""


class BodyWriter(Protocol):
    """The client's side of a started answer, written without ASGI messages (the server's own, `server._fast`)."""

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Write a whole answer (its `Content-Length` among `headers`) at once."""

    def write_body(self, data: bytes) -> bool:
        """Write a piece of the answer's body; False when the client cannot take more for now."""

    async def drained(self) -> None:
        """Wait until the client can take more (or has left)."""


async def relay(
    upstream: UpstreamResponse, send: Send, request_id: str, outcome: Outcome, writer: BodyWriter | None = None
) -> None:
    """Relay a committed answer to the client, recording what the metrics need of it.

    Args:
        upstream: the node's answer, from `Forwarder.open`.
        send: the client's ASGI send channel.
        request_id: the request's `X-Request-Id`.
        outcome: the request's outcome; `first_token_s` (streams), `answer_end` (an answer relayed to its end),
            and `relay_error` with `error_code` (an answer cut mid-way) are set.
        writer: the client's side written directly, when the server offers it: a whole answer goes in one call,
            and a stream is pumped (`UpstreamResponse.pump`) rather than read and sent event by event.

    Raises:
        UpstreamError: a plain body broke off after its headers were sent: the connection must break.
    """
    headers = upstream.headers
    # Node ids are ASCII by the registry's rule (`Node.id`): no escaping, one encode per answer.
    headers += [(b"x-request-id", request_id.encode()), (b"x-qiip-node", upstream.node_id.encode())]
    if upstream.sse:
        headers += [(b"x-accel-buffering", b"no"), (b"cache-control", b"no-cache")]
    if upstream.complete:
        headers.append((b"content-length", str(len(upstream.prefix)).encode()))
        if writer is not None:
            writer.answer(upstream.status_code, headers, upstream.prefix)
        else:
            await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers})
            await send({"type": "http.response.body", "body": upstream.prefix})
        outcome.answer_end = (b"", upstream.prefix)
        return
    await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": upstream.prefix, "more_body": True})
    if upstream.sse:
        # A stream is committed by its first data event, which leads the prefix: the first token is out.
        outcome.first_token_s = time.perf_counter() - outcome.started
    # The last two pieces relayed: the node's `usage` is in them (`[DONE]` may come in a read of its own).
    before, last = b"", upstream.prefix
    try:
        if writer is not None and upstream.pumpable:
            pieces = [before, last]
            while not await upstream.pump(writer.write_body, pieces):
                await writer.drained()
            before, last = pieces
        else:
            while chunk := await upstream.read():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                before, last = last, chunk
    except UpstreamError as exc:
        logger.warning("node %s failed mid-response: %s", upstream.node_id, exc.log_text)
        outcome.relay_error = exc
        if not upstream.sse:
            # Headers are out and the body is incomplete: the only honest signal left is to break the
            # connection, so the client cannot mistake a truncated body for a whole one.
            raise
        await send({"type": "http.response.body", "body": sse_error_event(exc), "more_body": True})
        await send({"type": "http.response.body", "body": SSE_DONE})
        outcome.error_code = exc.code
        return
    await send({"type": "http.response.body", "body": b""})
    outcome.answer_end = (before, last)


async def end_stream(send: Send, event: bytes) -> None:
    """End a stream stopped from outside with one error event and `data: [DONE]` (the client may be gone).

    Args:
        send: the client's ASGI send channel.
        event: the in-band error event (`sse_error_event`, or `SHUTDOWN_EVENT`).
    """
    with contextlib.suppress(Exception):
        await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": SSE_DONE})
