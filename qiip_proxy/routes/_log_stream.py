"""Server-sent events of a kept-then-live log, shared by the admin streams (`/admin/journal`,
`/admin/provisioning/{host}/logs`): first what the log keeps, then (when following) each new entry, a
`: heartbeat` comment when idle, and the end of the stream when the daemon begins to shut down.

The log hands out a subscription (`follow()`): a context manager giving the kept entries and a bounded queue of
new ones, which `None` ends (https://html.spec.whatwg.org/multipage/server-sent-events.html).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, TypeVar

from starlette.responses import StreamingResponse

if TYPE_CHECKING:
    from collections.abc import Sequence

    from qiip_proxy._gateway import Gateway

__all__ = ["SSE_HEADERS", "kept_then_live"]

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""No caching, and no buffering by a proxy in front (nginx's `X-Accel-Buffering`)."""

EntryT = TypeVar("EntryT")


def kept_then_live(
    gateway: Gateway,
    subscription: AbstractContextManager[tuple[Sequence[EntryT], asyncio.Queue[EntryT | None]]],
    render: Callable[[EntryT], bytes],
    *,
    follow: bool,
    heartbeat_s: float,
) -> StreamingResponse:
    """An `text/event-stream` answer of a log's kept entries, then (with `follow`) its new ones.

    Args:
        gateway: the daemon, whose shutdown ends the stream.
        subscription: the log's `follow()`: the kept entries and the queue of new ones (None ends it).
        render: one entry as an SSE event (`event: …\\ndata: …\\n\\n`).
        follow: keep streaming new entries; False ends after the kept ones.
        heartbeat_s: seconds of silence after which a `: heartbeat` comment is sent.
    """

    async def stream() -> AsyncIterator[bytes]:
        with subscription as (backlog, queue):

            def end() -> None:
                if queue.full():
                    queue.get_nowait()
                queue.put_nowait(None)

            gateway.on_shutdown_begun.add(end)
            try:
                for entry in backlog:
                    yield render(entry)
                if not follow or gateway.shutting_down:
                    return
                while True:
                    try:
                        item = await asyncio.wait_for(queue.get(), heartbeat_s)
                    except TimeoutError:
                        yield b": heartbeat\n\n"
                        continue
                    if item is None:
                        return
                    yield render(item)
            finally:
                gateway.on_shutdown_begun.discard(end)

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)
