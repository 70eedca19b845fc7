"""The fleet journal and the engine logs of the daemon's own nodes, for operators: `GET /admin/journal` and
`GET /admin/nodes/{id}/log`, behind the admin credentials like every `/admin` route.

Both answer server-sent events in the style of `/admin/provisioning/{host}/logs`: first what is kept, then (with
`follow=true`) each new entry as it comes, a `: heartbeat` comment when idle, and the end of the stream when the
daemon begins to shut down.

An engine log is only served for a node this daemon launched itself (`[[local_nodes]]`): its llama-server writes
`state_dir/logs/{id}.log`. The file is read from that directory only; a relaunch may start the file again
(truncated or replaced), which a follower sees as a `reset` event before the new file's lines. Any other node
(attached, registered, set up on another host) has no log here: 409 with the reason.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import Response, StreamingResponse

from qiip_core import NodeNotFound
from qiip_core.journal import JournalEntry
from qiip_proxy.routes._admin import AdminError, require_admin
from qiip_proxy.routes._common import gateway_of
from qiip_proxy.routes._log_stream import SSE_HEADERS, kept_then_live

if TYPE_CHECKING:
    from qiip_proxy._gateway import Gateway

__all__ = ["MAX_LOG_LINES", "router", "tail_lines"]

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])

MAX_LOG_LINES = 10_000
"""The most lines `GET /admin/nodes/{id}/log?lines=N` sends from the end of a log."""

_MAX_LINE_CHARS = 4_096
_POLL_S = 0.25


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


@router.get("/journal", response_class=StreamingResponse)
async def journal(
    request: Request,
    follow: Annotated[bool, Query(description="Keep streaming new entries (false: the kept ones, then end).")] = True,
    heartbeat_s: Annotated[float, Query(gt=0, le=300, description="Seconds between heartbeat comments.")] = 15.0,
) -> Response:
    """Server-sent events of the fleet journal: `event: entry` with `{seq, at, node, event, summary, reason, …}`
    (`qiip_core.journal.JournalEntry`), first the last 2,000 kept, then each new one, and `: heartbeat` when idle."""
    gateway = gateway_of(request)

    return kept_then_live(gateway, gateway.journal.follow(), _entry, follow=follow, heartbeat_s=heartbeat_s)


def _entry(entry: JournalEntry) -> bytes:
    return _sse("entry", entry.view())


def engine_log_path(gateway: Gateway, node_id: str) -> Path:
    """The engine log of a node this daemon launched: `state_dir/logs/{id}.log`.

    Raises:
        NodeNotFound: no node has this id (404).
        AdminError: 409 when the node's engine runs elsewhere (attached, registered, another host) and its log is
            not kept here, or its log would lie outside the logs directory.
    """
    state = gateway.table.get(node_id)
    server = gateway.local_nodes.servers.get(node_id)
    if server is None:
        if state is None:
            raise NodeNotFound(node_id)
        host = urlsplit(state.node.endpoint).hostname or state.node.endpoint
        if state.source == "attached":
            where = f"is an attached endpoint at {state.node.endpoint}"
            why = f"node {node_id!r} {where}; its engine log is not kept by this daemon"
        else:
            why = f"node {node_id!r} runs on host {host} ({state.source}); its engine log is not kept by this daemon"
        raise AdminError(
            409,
            why + ": only nodes this daemon launched itself ([[local_nodes]]) have one here.",
            "no_engine_log",
            "node_id",
        )
    logs_dir = (gateway.settings.state_dir / "logs").resolve()
    path = server.log_path.resolve()
    if path.parent != logs_dir:
        raise AdminError(
            409,
            f"The engine log of node {node_id!r} lies outside {logs_dir}; it is not served.",
            "no_engine_log",
            "node_id",
        )
    return path


def tail_lines(path: Path, lines: int, *, block_bytes: int = 65_536) -> tuple[list[str], int, int]:
    """The last `lines` complete lines of `path`, read from its end.

    Returns:
        `(lines, end_offset, inode)`: the lines without their newlines (each cut to 4,096 characters), the byte
        offset just after the last complete line, and the file's inode. A missing file is `([], 0, 0)`.
    """
    try:
        with path.open("rb") as handle:
            stat = os.fstat(handle.fileno())
            size = stat.st_size
            data = b""
            position = size
            while position > 0 and data.count(b"\n") <= lines:
                step = min(block_bytes, position)
                position -= step
                handle.seek(position)
                data = handle.read(step) + data
    except FileNotFoundError:
        return [], 0, 0
    complete = data[: data.rfind(b"\n") + 1]
    end = position + len(complete)
    found = complete.decode("utf-8", "replace").split("\n")[:-1]
    if position > 0:
        found = found[1:]  # the first line read may have begun before `position`
    return [line[:_MAX_LINE_CHARS] for line in found[-lines:]] if lines else [], end, stat.st_ino


def _read_from(path: Path, offset: int, inode: int) -> tuple[list[str], int, int, bool]:
    """The complete lines written to `path` after `offset`: `(lines, new_offset, inode, restarted)`; `restarted`
    when the file was replaced or truncated (then reading starts again at its beginning)."""
    try:
        with path.open("rb") as handle:
            stat = os.fstat(handle.fileno())
            restarted = stat.st_ino != inode or stat.st_size < offset
            if restarted:
                offset = 0
            handle.seek(offset)
            data = handle.read(1024 * 1024)
    except FileNotFoundError:
        return [], offset, inode, False
    complete = data[: data.rfind(b"\n") + 1]
    lines = complete.decode("utf-8", "replace").split("\n")[:-1]
    return [line[:_MAX_LINE_CHARS] for line in lines], offset + len(complete), stat.st_ino, restarted


@router.get("/nodes/{node_id}/log", response_class=StreamingResponse)
async def engine_log(
    request: Request,
    node_id: str,
    lines: Annotated[int, Query(ge=0, le=MAX_LOG_LINES, description="Lines to send from the end of the log.")] = 200,
    follow: Annotated[bool, Query(description="Keep streaming new lines (false: the last lines, then end).")] = True,
    heartbeat_s: Annotated[float, Query(gt=0, le=300, description="Seconds between heartbeat comments.")] = 15.0,
) -> Response:
    """Server-sent events of a local node's engine log (llama-server's output): `event: line` with `{line}`, the last
    `lines` lines (at most 10,000), then with `follow` each new one; `event: reset` with `{reason}` when the file
    starts again (a relaunch). 404 for an unknown node, 409 for a node whose engine log this daemon does not keep."""
    gateway = gateway_of(request)
    path = engine_log_path(gateway, node_id)

    async def stream() -> AsyncIterator[bytes]:
        ended = asyncio.Event()
        gateway.on_shutdown_begun.add(ended.set)
        try:
            backlog, offset, inode = await asyncio.to_thread(tail_lines, path, lines)
            for line in backlog:
                yield _sse("line", {"line": line})
            if not follow or gateway.shutting_down:
                return
            idle_s = 0.0
            while not ended.is_set():
                with_new, offset, inode, restarted = await asyncio.to_thread(_read_from, path, offset, inode)
                if restarted:
                    yield _sse("reset", {"reason": f"the engine log of {node_id} started again (a relaunch)"})
                for line in with_new:
                    yield _sse("line", {"line": line})
                if with_new or restarted:
                    idle_s = 0.0
                    continue
                with_timeout = asyncio.create_task(ended.wait())
                await asyncio.wait({with_timeout}, timeout=_POLL_S)
                with_timeout.cancel()
                idle_s += _POLL_S
                if idle_s >= heartbeat_s:
                    idle_s = 0.0
                    yield b": heartbeat\n\n"
        finally:
            gateway.on_shutdown_begun.discard(ended.set)

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)
