"""A scripted, fault-injecting stand-in for an inference node, speaking real HTTP/1.1 on loopback.

The gateway's failure handling is about bytes and timing: a node that resets the connection after the third
event, splits a UTF-8 character across two writes, answers 503 while it loads its model, or holds a request
open until the client gives up. A web framework would buffer, reframe or smooth over exactly what these tests
need to control, so this server sits on plain asyncio streams: every body write is one `transport.write`
(one HTTP chunk when the response is chunked), a clean close is a FIN and a reset is a real TCP RST.

The server runs on its own event loop in a daemon thread, so synchronous and asynchronous tests drive it the
same way, and every public method is thread-safe:

    with FaultBackend(model="m") as backend:
        backend.push(Sse(reset_after_events=2))       # the next inference request gets this
        backend.health = LoadingThenOk(loading_s=1)   # /health answers 503 for one second
        ...                                           # point the gateway at backend.url
        backend.wait_for_disconnect()                 # the gateway hung up on the node

Routing: `GET /health` answers `backend.health`; `GET /v1/models` lists the model; `POST` to
`/v1/chat/completions`, `/v1/completions` or `/v1/embeddings` answers the head of the queue filled by
`push()`, else `backend.default` (`Completion()`). Anything else is a 404. Every request is recorded.

A connection has one reader task for its whole life. It buffers what the client sends (the request parser
reads from that buffer) and so notices at once when the client goes away, even while a behaviour is sleeping
or streaming. Behaviours are frozen dataclasses whose `respond()` drives an `Exchange`; a test can add its
own by subclassing `Behaviour`.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import contextlib
import gzip as gzip_module
import hashlib
import http
import itertools
import json
import logging
import random
import re
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "Behaviour",
    "ClientGone",
    "Completion",
    "Embeddings",
    "Exchange",
    "FaultBackend",
    "Hang",
    "Json",
    "LoadingThenOk",
    "RequestRecord",
    "Sse",
    "Status",
    "big_line_event",
]

logger = logging.getLogger("qiip.tests.fault_backend")

MAX_HEAD_BYTES = 64 * 1024
"""A request line plus headers longer than this is rejected with 400."""

MAX_BODY_BYTES = 64 * 1024 * 1024
"""A request body longer than this is rejected with 413."""

INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
"""The POST paths answered by the queue or the default behaviour."""

_READ_BYTES = 64 * 1024
_SHUTDOWN_TIMEOUT_S = 10.0
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(rb"HTTP/1\.[01]")
_TARGET = re.compile(rb"[\x21-\x7e]+")


# -- Records -------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestRecord:
    """One request the backend received. `FaultBackend.requests` hands out copies, so they never change.

    Attributes:
        method: the request method, for example `POST`.
        path: the request target as sent, query string included.
        headers: the request headers, names lower-cased; repeated headers are joined with ", ".
        body: the request body, de-chunked when it came with `Transfer-Encoding: chunked`.
        json: the body parsed as JSON, or None when it is empty or not JSON.
        received_at: `time.monotonic()` when the whole request had been read.
        disconnected_at: `time.monotonic()` when the client went away while the backend was still answering
            (or delaying its answer); None when it did not.
        completed: True once the whole response went out as a well-formed HTTP message; False for a response
            cut short by a scripted fault or by the client leaving.
        connection: serial number (from 1) of the TCP connection that carried the request, to tell keep-alive
            reuse from new connections.
    """

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    json: Any | None
    received_at: float
    disconnected_at: float | None = None
    completed: bool = False
    connection: int = 0


# -- The exchange: what behaviours drive ---------------------------------------------------------------------


class ClientGone(Exception):
    """The connection is gone: the client closed or reset it (which is recorded), or the backend closed it.

    Raised by `Exchange` waits and writes; a behaviour lets it propagate.
    """


class Exchange:
    """One request being answered: the handle a `Behaviour` writes its response through.

    A response is either whole (`send_response()`) or streamed (`start_stream()`, `send()` per write,
    `end_stream()`), or cut short with `reset()` or `close()`. Every wait and write raises `ClientGone` as
    soon as the client has gone away.

    Attributes:
        request: the request being answered.
        model: the model the backend serves.
        port: the backend's port.
        set_at: `time.monotonic()` when the behaviour was assigned or pushed.
        serial: a number unique to this request on this backend, for response ids.
    """

    def __init__(self, conn: _Connection, record: RequestRecord, *, set_at: float, keep_alive: bool) -> None:
        self._conn = conn
        self._record = record
        self.request = replace(record)
        self.model = conn.backend.model
        self.port = conn.backend.port
        self.set_at = set_at
        self.serial = conn.backend._next_serial()
        self._keep_alive = keep_alive
        self._chunked = False
        self._head_sent = False
        self._reusable = False  # the response went out in full and the connection may carry another request

    @property
    def api_path(self) -> str:
        """The request path without its query string."""
        return self.request.path.split("?", 1)[0]

    @property
    def payload(self) -> dict[str, Any]:
        """The request body as a JSON object, or an empty dict when it is not one."""
        return self.request.json if isinstance(self.request.json, dict) else {}

    async def sleep(self, seconds: float) -> None:
        """Wait, but stop as soon as the client goes away.

        Args:
            seconds: how long to wait; zero or less only checks the connection.

        Raises:
            ClientGone: the client went away before or during the wait.
        """
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await self._conn.gone.wait()
        if self._conn.gone.is_set():
            raise ClientGone

    async def wait_for_client_to_leave(self) -> None:
        """Wait until the client closes or resets the connection (or the backend shuts down)."""
        await self._conn.gone.wait()

    async def send_response(self, status: int, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        """Send a whole response with a Content-Length.

        Args:
            status: the status code.
            body: the body, sent in the same write as the head.
            headers: extra headers; they override the defaults (Content-Length included, to fake a bad one).

        Raises:
            ClientGone: the client went away.
        """
        merged = {"content-length": str(len(body))}
        merged.update(_lower(headers))
        head = self._head(status, merged)
        await self._write(head + body, last=True)

    async def start_stream(self, status: int, headers: Mapping[str, str] | None = None, *, chunked: bool) -> None:
        """Send the head of a streamed response.

        Args:
            status: the status code.
            headers: extra headers; they override the framing headers.
            chunked: True for `Transfer-Encoding: chunked`; False for a body that ends when the connection
                closes (the response then carries `Connection: close`).

        Raises:
            ClientGone: the client went away.
        """
        self._chunked = chunked
        merged = {"transfer-encoding": "chunked"} if chunked else {"connection": "close"}
        merged.update(_lower(headers))
        await self._write(self._head(status, merged))

    async def send(self, data: bytes) -> None:
        """Send one body write of a streamed response: one HTTP chunk when chunked, else the bytes as they are.

        An empty write is skipped when chunked, since an empty chunk would end the body.

        Raises:
            ClientGone: the client went away.
        """
        if self._chunked:
            if not data:
                return
            data = b"%x\r\n%b\r\n" % (len(data), data)
        await self._write(data)

    async def end_stream(self) -> None:
        """End a streamed response properly: the final chunk when chunked, else a clean close.

        Raises:
            ClientGone: the client went away.
        """
        if self._chunked:
            await self._write(b"0\r\n\r\n", last=True)
        else:
            self._complete()
            await self.close()

    def reset(self) -> None:
        """Abort the connection with a TCP RST (SO_LINGER 0), whatever was sent so far."""
        self._conn.closed_by_backend = True
        self._conn.gone.set()
        sock = self._conn.writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._conn.writer.transport.abort()

    async def close(self) -> None:
        """Close the connection cleanly (a FIN) after what was sent so far, without ending the response."""
        await self._conn.close()

    def _head(self, status: int, headers: Mapping[str, str]) -> bytes:
        if self._head_sent:
            raise RuntimeError("The response head was already sent; a behaviour can send it only once.")
        self._head_sent = True
        if not self._keep_alive:
            headers = {**headers, "connection": "close"}
        if headers.get("connection", "").lower() == "close":
            self._keep_alive = False
        try:
            reason = http.HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
        lines = [f"HTTP/1.1 {status} {reason}"]
        lines.extend(f"{name}: {value}" for name, value in headers.items())
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _write(self, data: bytes, *, last: bool = False) -> None:
        if self._conn.gone.is_set() or self._conn.writer.transport.is_closing():
            raise ClientGone
        if last:
            # Recorded before the bytes leave: a client that has read the whole response (on another
            # thread) must already find its request completed.
            self._complete()
        self._conn.writer.write(data)
        try:
            await self._conn.writer.drain()
        except (ConnectionError, OSError) as exc:
            if not self._conn.closed_by_backend:
                self._conn.backend._update(self._record, completed=False, disconnected_at=time.monotonic())
            raise ClientGone from exc

    def _complete(self) -> None:
        self._reusable = self._keep_alive
        self._conn.backend._update(self._record, completed=True)
        self._conn.active = None

    def _client_left(self) -> None:
        if self._conn.active is self and not self._conn.closed_by_backend:
            self._conn.backend._update(self._record, disconnected_at=time.monotonic())


# -- Behaviours ----------------------------------------------------------------------------------------------


class Behaviour(abc.ABC):
    """How the backend answers one request. Subclasses are frozen dataclasses, so one value can be reused."""

    @abc.abstractmethod
    async def respond(self, exchange: Exchange) -> None:
        """Answer the request through `exchange`.

        Raises:
            ClientGone: the client went away (the connection is then closed without further ado).
        """


@dataclass(frozen=True)
class Json(Behaviour):
    """A complete JSON response with a Content-Length.

    Attributes:
        status: the status code.
        body: a JSON value to serialise, or the exact body bytes.
        headers: extra response headers (they override the defaults).
        delay_s: seconds to wait before answering (a client leaving meanwhile is recorded).
        gzip: compress the body and send `Content-Encoding: gzip`.
    """

    status: int = 200
    body: dict[str, Any] | list[Any] | bytes = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    gzip: bool = False

    async def respond(self, exchange: Exchange) -> None:
        await exchange.sleep(self.delay_s)
        body = self.body if isinstance(self.body, bytes) else _dumps(self.body)
        headers = {"content-type": "application/json"}
        if self.gzip:
            body = gzip_module.compress(body, mtime=0)
            headers["content-encoding"] = "gzip"
        headers.update(_lower(self.headers))
        await exchange.send_response(self.status, body, headers)


@dataclass(frozen=True)
class Status(Behaviour):
    """An error status, such as `Status(429, headers={"Retry-After": "7"})` or `Status(500)`.

    Attributes:
        status: the status code.
        body: None for an OpenAI-shaped error object naming the status; a dict to send as JSON; or exact
            bytes (sent as JSON when they parse as JSON, else as text/plain).
        headers: extra response headers.
    """

    status: int
    body: dict[str, Any] | bytes | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    async def respond(self, exchange: Exchange) -> None:
        body: dict[str, Any] | bytes
        if self.body is None:
            body = _error_body(self.status, f"Injected fault: status {self.status}.")
        else:
            body = self.body
        headers = dict(_lower(self.headers))
        if isinstance(body, bytes) and _parse_json(body) is None:
            headers.setdefault("content-type", "text/plain; charset=utf-8")
        await Json(self.status, body, headers).respond(exchange)


@dataclass(frozen=True)
class Sse(Behaviour):
    """A server-sent event stream (`Content-Type: text/event-stream`), with faults placed exactly.

    The body is a list of writes, each sent (and flushed) on its own: by default `n_events` OpenAI
    `chat.completion.chunk` events with delta contents "tok0 ", "tok1 ", ..., the last with finish_reason
    "stop", then `data: [DONE]` when `done`. `events` replaces the generated events (`done` still appends
    `[DONE]`); `writes` replaces the whole body, so one event or one UTF-8 character can be split across writes.

    Attributes:
        events: the exact bytes of each event, blank line included.
        n_events: how many chunk events to generate when neither `events` nor `writes` is given.
        writes: the exact body writes; overrides `events`, `n_events` and `done`.
        delay_headers_s: seconds to wait before sending the head.
        delay_first_event_s: seconds to wait between the head and the first write.
        delay_between_s: seconds to wait between writes (and before a reset after the last of them).
        reset_after_events: send this many writes, then abort the connection with a TCP RST instead of the
            next write (or instead of the end of the body when there are no more writes).
        reset_before_headers: read the request, then reset the connection without answering.
        close_after_headers: send the head, then close the connection cleanly without any body.
        done: append `data: [DONE]` to the events.
        chunked: chunked transfer encoding (each write one chunk); False ends the body by closing the
            connection.
        headers: extra response headers.
    """

    events: Sequence[bytes] | None = None
    n_events: int = 5
    writes: Sequence[bytes] | None = None
    delay_headers_s: float = 0.0
    delay_first_event_s: float = 0.0
    delay_between_s: float = 0.0
    reset_after_events: int | None = None
    reset_before_headers: bool = False
    close_after_headers: bool = False
    done: bool = True
    chunked: bool = True
    headers: Mapping[str, str] = field(default_factory=dict)

    def body_writes(self, exchange: Exchange) -> list[bytes]:
        """The writes this stream sends for `exchange`, before any reset.

        Returns:
            One item per write.
        """
        if self.writes is not None:
            return list(self.writes)
        if self.events is not None:
            events = list(self.events)
        else:
            completion_id = f"chatcmpl-fault-{exchange.port}-{exchange.serial}"
            created = int(time.time())
            events = [
                _sse_event(
                    _chat_chunk(
                        completion_id,
                        exchange.model,
                        created,
                        content=f"tok{i} ",
                        role="assistant" if i == 0 else None,
                        finish_reason="stop" if i == self.n_events - 1 else None,
                    )
                )
                for i in range(self.n_events)
            ]
        if self.done:
            events.append(b"data: [DONE]\n\n")
        return events

    async def respond(self, exchange: Exchange) -> None:
        if self.reset_before_headers:
            exchange.reset()
            return
        await exchange.sleep(self.delay_headers_s)
        headers = {"content-type": "text/event-stream", "cache-control": "no-cache"}
        headers.update(_lower(self.headers))
        await exchange.start_stream(200, headers, chunked=self.chunked)
        if self.close_after_headers:
            await exchange.close()
            return
        sent = 0
        for data in self.body_writes(exchange):
            if sent == self.reset_after_events:
                break
            await exchange.sleep(self.delay_between_s if sent else self.delay_first_event_s)
            await exchange.send(data)
            sent += 1
        if self.reset_after_events is not None:
            await exchange.sleep(self.delay_between_s if sent else self.delay_first_event_s)
            exchange.reset()
            return
        await exchange.end_stream()


@dataclass(frozen=True)
class Hang(Behaviour):
    """Read the request and never answer, until the client goes away (which is recorded)."""

    async def respond(self, exchange: Exchange) -> None:
        await exchange.wait_for_client_to_leave()


@dataclass(frozen=True)
class Gated(Behaviour):
    """Hold the request until the test sets `gate`, then answer with `then`.

    For tests that must observe the gateway while a request is in flight, whatever the machine's speed.

    Attributes:
        gate: a `threading.Event` the test sets to release the request.
        then: the behaviour that answers once released.
    """

    gate: threading.Event
    then: Behaviour

    async def respond(self, exchange: Exchange) -> None:
        while not self.gate.is_set():
            await exchange.sleep(0.02)
        await self.then.respond(exchange)


@dataclass(frozen=True)
class LoadingThenOk(Behaviour):
    """llama-server's health while it loads its model: 503 for `loading_s` seconds after being set, then 200.

    The 503 body is llama-server's: `{"error": {"code": 503, "message": "Loading model", "type":
    "unavailable_error"}}`; the 200 body is `{"status": "ok"}`.

    Attributes:
        loading_s: seconds, from the moment the behaviour is assigned or pushed, during which it answers 503.
    """

    loading_s: float

    async def respond(self, exchange: Exchange) -> None:
        if time.monotonic() - exchange.set_at < self.loading_s:
            body = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
            await Json(503, body).respond(exchange)
        else:
            await Json(200, {"status": "ok"}).respond(exchange)


@dataclass(frozen=True)
class Embeddings(Behaviour):
    """A valid OpenAI embeddings response, one deterministic unit vector per input.

    Inputs may be a string, a list of strings, a list of token ids or a list of token-id lists. With
    `"encoding_format": "base64"` (the openai client's default) each vector is little-endian float32 in
    base64. A request without input gets a 400.

    Attributes:
        dim: the vector length.
    """

    dim: int = 8

    async def respond(self, exchange: Exchange) -> None:
        payload = exchange.payload
        raw = payload.get("input")
        if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw)):
            items: list[Any] = [raw]
        elif isinstance(raw, list) and raw:
            items = raw
        else:
            body = _error_body(400, "The request needs an 'input'.", error_type="invalid_request_error")
            await Json(400, body).respond(exchange)
            return
        as_base64 = payload.get("encoding_format") == "base64"
        data = []
        for index, item in enumerate(items):
            vector = _unit_vector(item, self.dim)
            embedding: list[float] | str = vector
            if as_base64:
                embedding = base64.b64encode(struct.pack(f"<{self.dim}f", *vector)).decode("ascii")
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        tokens = sum(_count_tokens(item) for item in items)
        body = {
            "object": "list",
            "data": data,
            "model": exchange.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        await Json(200, body).respond(exchange)


@dataclass(frozen=True)
class Completion(Behaviour):
    """A valid answer for whichever inference path was called: the backend's default behaviour.

    `/v1/chat/completions` gets a `chat.completion`, `/v1/completions` a `text_completion`, both with usage
    and the content "tok0 tok1 ...". With `"stream": true` the same content is streamed as in `Sse()` (chunks
    of the matching object type), ending with a usage chunk (`choices: []`) when
    `stream_options.include_usage` is true. `/v1/embeddings` is answered as by `Embeddings()`.

    Attributes:
        n_tokens: how many tokens the completion has.
    """

    n_tokens: int = 5

    async def respond(self, exchange: Exchange) -> None:
        path = exchange.api_path
        if path == "/v1/embeddings":
            await Embeddings().respond(exchange)
            return
        payload = exchange.payload
        chat = path != "/v1/completions"
        completion_id = f"{'chatcmpl' if chat else 'cmpl'}-fault-{exchange.port}-{exchange.serial}"
        created = int(time.time())
        prompt_tokens = _count_prompt_tokens(payload)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.n_tokens,
            "total_tokens": prompt_tokens + self.n_tokens,
        }
        tokens = [f"tok{i} " for i in range(self.n_tokens)]
        if payload.get("stream") is True:
            options = payload.get("stream_options")
            include_usage = isinstance(options, dict) and options.get("include_usage") is True
            chunks = []
            for i, token in enumerate(tokens):
                finish_reason = "stop" if i == len(tokens) - 1 else None
                if chat:
                    role = "assistant" if i == 0 else None
                    chunk = _chat_chunk(
                        completion_id, exchange.model, created, content=token, role=role, finish_reason=finish_reason
                    )
                else:
                    chunk = _text_chunk(completion_id, exchange.model, created, token, finish_reason)
                if include_usage:
                    chunk["usage"] = None
                chunks.append(chunk)
            if include_usage:
                object_name = "chat.completion.chunk" if chat else "text_completion"
                chunks.append(_envelope(completion_id, object_name, created, exchange.model, [], usage=usage))
            await Sse(events=[_sse_event(chunk) for chunk in chunks]).respond(exchange)
            return
        content = "".join(tokens)
        if chat:
            message = {"role": "assistant", "content": content}
            choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
            body = _envelope(completion_id, "chat.completion", created, exchange.model, [choice], usage=usage)
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": "stop"}
            body = _envelope(completion_id, "text_completion", created, exchange.model, [choice], usage=usage)
        await Json(200, body).respond(exchange)


def big_line_event(size_bytes: int = 1 << 20, *, model: str = "fault-model") -> bytes:
    """One `data: {...}\\n\\n` event holding a valid chat.completion.chunk, padded to `size_bytes` in total.

    Args:
        size_bytes: the length of the whole event in bytes; an event never gets shorter than its JSON
            envelope (about 200 bytes).
        model: the model named in the chunk.

    Returns:
        The event's bytes, blank line included.
    """
    created = int(time.time())
    empty = _sse_event(_chat_chunk("chatcmpl-fault-big", model, created, content=""))
    padding = max(0, size_bytes - len(empty))
    return _sse_event(_chat_chunk("chatcmpl-fault-big", model, created, content="x" * padding))


# -- The backend ---------------------------------------------------------------------------------------------


class FaultBackend:
    """A scripted inference node on 127.0.0.1, on its own event loop in a daemon thread.

    It listens as soon as it is built; use it as a context manager (or call `close()`). All methods are
    thread-safe, but must not be called from inside a behaviour, which runs on the backend's own loop.

    Args:
        model: the model the node serves, listed by `/v1/models` and named in responses.

    Raises:
        OSError: no port could be bound on 127.0.0.1.
    """

    def __init__(self, *, model: str = "fault-model") -> None:
        self.model = model
        self._cond = threading.Condition()
        self._queue: deque[tuple[Behaviour, float]] = deque()
        self._records: list[RequestRecord] = []
        now = time.monotonic()
        self._health: tuple[Behaviour, float] = (Json(200, {"status": "ok"}), now)
        self._default: tuple[Behaviour, float] = (Completion(), now)
        self._serials = itertools.count(1)
        self._connection_ids = itertools.count(1)
        # Loop-thread state below.
        self._port = 0
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.Transport] = set()
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="fault-backend", daemon=True)
        self._thread.start()
        try:
            self._call(self._listen())
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> FaultBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<FaultBackend {self.url} model={self.model!r}>"

    @property
    def port(self) -> int:
        """The TCP port, the same for the backend's whole life."""
        return self._port

    @property
    def url(self) -> str:
        """The base URL, `http://127.0.0.1:PORT`."""
        return f"http://127.0.0.1:{self._port}"

    @property
    def health(self) -> Behaviour:
        """How `GET /health` answers; `Json(200, {"status": "ok"})` until set. Setting it restarts its clock."""
        with self._cond:
            return self._health[0]

    @health.setter
    def health(self, behaviour: Behaviour) -> None:
        with self._cond:
            self._health = (behaviour, time.monotonic())

    @property
    def default(self) -> Behaviour:
        """How inference requests are answered when the queue is empty; `Completion()` until set."""
        with self._cond:
            return self._default[0]

    @default.setter
    def default(self, behaviour: Behaviour) -> None:
        with self._cond:
            self._default = (behaviour, time.monotonic())

    @property
    def requests(self) -> list[RequestRecord]:
        """A snapshot of every request received since the start or the last `reset()`, oldest first."""
        with self._cond:
            return [replace(record) for record in self._records]

    def push(self, *behaviours: Behaviour) -> None:
        """Queue behaviours for the next inference requests, one each, before the default applies again.

        Args:
            behaviours: answers for the next requests, in order.
        """
        now = time.monotonic()
        with self._cond:
            self._queue.extend((behaviour, now) for behaviour in behaviours)

    def reset(self) -> None:
        """Forget the queued behaviours and the recorded requests (health and default stay as they are)."""
        with self._cond:
            self._queue.clear()
            self._records.clear()

    def wait_for_requests(self, n: int, timeout_s: float = 5.0, *, path: str | None = None) -> list[RequestRecord]:
        """Wait until at least `n` requests (to `path`, when given, query string ignored) have been received.

        Args:
            n: how many requests to wait for.
            timeout_s: seconds to wait at most.
            path: count only requests to this path, for example "/v1/chat/completions".

        Returns:
            A snapshot of the matching requests.

        Raises:
            TimeoutError: fewer than `n` matching requests arrived in time.
        """

        def matching() -> list[RequestRecord]:
            return [r for r in self._records if path is None or r.path.split("?", 1)[0] == path]

        with self._cond:
            if not self._cond.wait_for(lambda: len(matching()) >= n, timeout_s):
                got = len(matching())
                raise TimeoutError(f"The backend received {got} of the {n} awaited requests in {timeout_s} s.")
            return [replace(record) for record in matching()]

    def wait_for_disconnect(self, index: int = -1, timeout_s: float = 5.0) -> float:
        """Wait until the client of request `index` goes away while the backend is answering it.

        Args:
            index: position in `requests` (-1 is the latest request at each check).
            timeout_s: seconds to wait at most.

        Returns:
            The `time.monotonic()` of the disconnect.

        Raises:
            TimeoutError: no such request arrived, or its client did not disconnect, in time.
        """

        def disconnected_at() -> float | None:
            try:
                return self._records[index].disconnected_at
            except IndexError:
                return None

        with self._cond:
            if not self._cond.wait_for(lambda: disconnected_at() is not None, timeout_s):
                raise TimeoutError(f"The client of request {index} did not disconnect within {timeout_s} s.")
            at = disconnected_at()
            assert at is not None
            return at

    def stop_listening(self, *, drop_connections: bool = False) -> None:
        """Close the listening socket, so new connections are refused; open connections carry on.

        Args:
            drop_connections: also close every open connection (cleanly), like a node that went away.

        Raises:
            RuntimeError: the backend is closed.
        """
        self._call(self._stop_listening(drop_connections=drop_connections))

    def start_listening(self) -> None:
        """Listen again on the same port after `stop_listening()`; nothing happens if already listening.

        Raises:
            RuntimeError: the backend is closed.
            OSError: the port was taken by someone else meanwhile.
        """
        self._call(self._listen())

    def close(self) -> None:
        """Stop the server: close every connection, cancel its tasks, close the loop and join the thread.

        Calling it again does nothing.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(_SHUTDOWN_TIMEOUT_S)
            except Exception:
                logger.exception("The fault backend did not shut down cleanly.")
            # The loop thread cancels what is left, then closes the loop.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_SHUTDOWN_TIMEOUT_S)

    # -- Called on the loop thread ----------------------------------------------------------------------

    def _next_serial(self) -> int:
        return next(self._serials)

    def _pick(self, method: str, path: str) -> tuple[Behaviour, float]:
        with self._cond:
            if path == "/health" and method == "GET":
                return self._health
            if path == "/v1/models" and method == "GET":
                model = {"id": self.model, "object": "model", "owned_by": "fault"}
                return Json(200, {"object": "list", "data": [model]}), 0.0
            if path in INFERENCE_PATHS and method == "POST":
                return self._queue.popleft() if self._queue else self._default
        if path in INFERENCE_PATHS or path in ("/health", "/v1/models"):
            return Status(405, _error_body(405, f"{method} is not allowed on {path}.")), 0.0
        return Status(404, _error_body(404, f"There is no {path} on this backend.")), 0.0

    def _add(self, record: RequestRecord) -> None:
        with self._cond:
            self._records.append(record)
            self._cond.notify_all()

    def _update(self, record: RequestRecord, **changes: Any) -> None:
        with self._cond:
            for name, value in changes.items():
                if name == "disconnected_at" and record.disconnected_at is not None:
                    continue
                setattr(record, name, value)
            self._cond.notify_all()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            try:
                pending = asyncio.all_tasks(self._loop)
                for task in pending:
                    task.cancel()
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            finally:
                self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        if self._closed or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("The fault backend is closed; create a new one.")
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(_SHUTDOWN_TIMEOUT_S)

    async def _listen(self) -> None:
        if self._server is not None:
            return
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _TrackingProtocol(self, loop), host="127.0.0.1", port=self._port, reuse_address=True
        )
        self._port = self._server.sockets[0].getsockname()[1]

    async def _stop_listening(self, *, drop_connections: bool) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if drop_connections:
            for conn in list(self._connections):
                await conn.close()

    async def _shutdown(self) -> None:
        await self._stop_listening(drop_connections=False)
        for conn in list(self._connections):
            conn.closed_by_backend = True
            conn.gone.set()
        for transport in list(self._transports):
            transport.abort()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        conn = _Connection(self, reader, writer, next(self._connection_ids))
        self._connections.add(conn)
        try:
            await conn.serve()
        except ClientGone:
            pass
        except asyncio.CancelledError:
            # Only _shutdown() cancels handlers. Ending normally keeps Python 3.11's stream callback from
            # logging an error for a cancelled task (https://github.com/python/cpython/issues/113538).
            pass
        except Exception:
            logger.exception("The fault backend failed on connection %d; closing it.", conn.id)
        finally:
            self._connections.discard(conn)
            self._handlers.discard(task)
            await conn.close()


class _TrackingProtocol(asyncio.StreamReaderProtocol):
    """Streams protocol that registers its transport, so shutdown can close connections whose handler
    task has not started yet (they would otherwise leak a socket and a ResourceWarning)."""

    def __init__(self, backend: FaultBackend, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(asyncio.StreamReader(loop=loop), backend._serve_connection, loop=loop)
        self._backend = backend
        self._transport_seen: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport_seen = transport
        self._backend._transports.add(transport)
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport_seen is not None:
            self._backend._transports.discard(self._transport_seen)
        super().connection_lost(exc)


class _BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class _Incomplete(Exception):
    """The client closed the connection in the middle of a request."""


@dataclass(slots=True)
class _ParsedRequest:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


class _Connection:
    """One client connection: a reader task that buffers input and notices EOF, and the request loop."""

    def __init__(
        self, backend: FaultBackend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn_id: int
    ) -> None:
        self.backend = backend
        self.reader = reader
        self.writer = writer
        self.id = conn_id
        self.buffer = bytearray()
        self.eof = False
        self.gone = asyncio.Event()
        """Set when the client closed or reset the connection, or the backend closed it."""
        self.closed_by_backend = False
        self.active: Exchange | None = None
        """The exchange whose response is in progress, whose record a disconnect goes to."""
        self._data = asyncio.Event()
        self._pump_task = asyncio.create_task(self._pump())

    async def serve(self) -> None:
        while True:
            try:
                request = await self._read_request()
            except _Incomplete:
                logger.debug("Connection %d closed in the middle of a request.", self.id)
                return
            except _BadRequest as exc:
                logger.warning("The fault backend rejected a malformed request on connection %d: %s", self.id, exc)
                await self._reject(exc)
                return
            if request is None:
                return
            if not await self._answer(request):
                return

    async def close(self) -> None:
        """Close the connection cleanly, stop the reader task and wait for the socket to close."""
        if self.writer.transport.is_closing() and self._pump_task.done():
            return
        self.closed_by_backend = True
        self.gone.set()
        self._pump_task.cancel()
        await asyncio.gather(self._pump_task, return_exceptions=True)
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()

    async def _answer(self, request: _ParsedRequest) -> bool:
        record = RequestRecord(
            method=request.method,
            path=request.target,
            headers=request.headers,
            body=request.body,
            json=_parse_json(request.body),
            received_at=time.monotonic(),
            connection=self.id,
        )
        self.backend._add(record)
        behaviour, set_at = self.backend._pick(request.method, request.target.split("?", 1)[0])
        exchange = Exchange(self, record, set_at=set_at, keep_alive=request.keep_alive)
        self.active = exchange
        try:
            if self.gone.is_set():
                # The client left while its request was being read to the end.
                exchange._client_left()
                return False
            await behaviour.respond(exchange)
        finally:
            self.active = None
        return exchange._reusable and not self.gone.is_set()

    async def _pump(self) -> None:
        try:
            while data := await self.reader.read(_READ_BYTES):
                self.buffer += data
                self._data.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self.eof = True
            self._data.set()
            if not self.closed_by_backend:
                if self.active is not None:
                    self.active._client_left()
                self.gone.set()

    async def _more(self) -> None:
        """Wait for more input; raise `_Incomplete` when no more will come."""
        if self.eof:
            raise _Incomplete
        self._data.clear()
        await self._data.wait()

    async def _read_until(self, separator: bytes, limit: int) -> bytes:
        start = 0
        while (found := self.buffer.find(separator, start)) < 0:
            if len(self.buffer) > limit:
                raise _BadRequest(f"No {separator!r} within {limit} bytes.", 431 if limit == MAX_HEAD_BYTES else 400)
            start = max(0, len(self.buffer) - len(separator) + 1)
            await self._more()
        data = bytes(self.buffer[:found])
        del self.buffer[: found + len(separator)]
        return data

    async def _read_exactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            await self._more()
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    async def _read_request(self) -> _ParsedRequest | None:
        # Between requests, stray CRLFs are ignored (RFC 9112, section 2.2); EOF here is a clean close.
        while True:
            while self.buffer[:2] == b"\r\n":
                del self.buffer[:2]
            if self.buffer and self.buffer != b"\r":
                break
            if self.eof:
                return None
            await self._more()
        head = await self._read_until(b"\r\n\r\n", MAX_HEAD_BYTES)
        request_line, *header_lines = head.split(b"\r\n")
        parts = request_line.split(b" ")
        if (
            len(parts) != 3
            or not _TOKEN.fullmatch(parts[0])
            or not _TARGET.fullmatch(parts[1])
            or not _VERSION.fullmatch(parts[2])
        ):
            raise _BadRequest(f"Malformed request line {request_line[:100]!r}.")
        method, target, version = (part.decode("latin-1") for part in parts)
        headers: dict[str, str] = {}
        for line in header_lines:
            name, colon, value = line.partition(b":")
            if not colon or not _TOKEN.fullmatch(name) or b"\r" in value or b"\n" in value:
                raise _BadRequest(f"Malformed header line {line[:100]!r}.")
            key = name.decode("latin-1").lower()
            text = value.strip(b" \t").decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        connection = {token.strip() for token in headers.get("connection", "").lower().split(",")}
        keep_alive = "keep-alive" in connection if version == "HTTP/1.0" else "close" not in connection
        if headers.get("expect", "").lower() == "100-continue":
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = await self._read_body(headers)
        return _ParsedRequest(method, target, headers, body, keep_alive)

    async def _read_body(self, headers: dict[str, str]) -> bytes:
        if "transfer-encoding" in headers:
            codings = [coding.strip().lower() for coding in headers["transfer-encoding"].split(",")]
            if codings[-1] != "chunked":
                raise _BadRequest(f"Unsupported request Transfer-Encoding {headers['transfer-encoding']!r}.")
            return await self._read_chunked()
        if "content-length" in headers:
            values = {value.strip() for value in headers["content-length"].split(",")}
            value = values.pop()
            if values or not value.isdigit():
                raise _BadRequest(f"Invalid Content-Length {headers['content-length']!r}.")
            if int(value) > MAX_BODY_BYTES:
                raise _BadRequest(f"The body of {value} bytes exceeds {MAX_BODY_BYTES}.", 413)
            return await self._read_exactly(int(value))
        return b""

    async def _read_chunked(self) -> bytes:
        body = bytearray()
        while True:
            size_line = await self._read_until(b"\r\n", 1024)
            size_text = size_line.split(b";", 1)[0].strip()
            if not size_text or not all(c in b"0123456789abcdefABCDEF" for c in size_text):
                raise _BadRequest(f"Malformed chunk size {size_line[:100]!r}.")
            size = int(size_text, 16)
            if size == 0:
                while await self._read_until(b"\r\n", MAX_HEAD_BYTES):
                    pass  # trailer fields are read and dropped
                return bytes(body)
            if len(body) + size > MAX_BODY_BYTES:
                raise _BadRequest(f"The chunked body exceeds {MAX_BODY_BYTES} bytes.", 413)
            body += await self._read_exactly(size)
            if await self._read_exactly(2) != b"\r\n":
                raise _BadRequest("A chunk is not followed by CRLF.")

    async def _reject(self, exc: _BadRequest) -> None:
        body = _dumps(_error_body(exc.status, str(exc), error_type="invalid_request_error"))
        reason = http.HTTPStatus(exc.status).phrase
        head = (
            f"HTTP/1.1 {exc.status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.writer.write(head.encode("latin-1") + body)
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.drain()


# -- Payload helpers -----------------------------------------------------------------------------------------


def _lower(headers: Mapping[str, str] | None) -> dict[str, str]:
    return {name.lower(): value for name, value in (headers or {}).items()}


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def _parse_json(body: bytes) -> Any | None:
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def _sse_event(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + _dumps(payload) + b"\n\n"


def _error_body(status: int, message: str, *, error_type: str = "server_error") -> dict[str, Any]:
    if 400 <= status < 500 and error_type == "server_error":
        error_type = "invalid_request_error"
    return {"error": {"message": message, "type": error_type, "code": status}}


def _envelope(
    completion_id: str,
    object_name: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    *,
    usage: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": completion_id,
        "object": object_name,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = dict(usage)
    return body


def _chat_chunk(
    completion_id: str,
    model: str,
    created: int,
    *,
    content: str,
    role: str | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": role} if role else {}
    delta["content"] = content
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return _envelope(completion_id, "chat.completion.chunk", created, model, [choice])


def _text_chunk(completion_id: str, model: str, created: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _envelope(completion_id, "text_completion", created, model, [choice])


def _count_tokens(value: Any) -> int:
    """A stand-in tokenizer: words in strings, items in token-id lists."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(1 if isinstance(item, int) else _count_tokens(item) for item in value)
    return 0


def _count_prompt_tokens(payload: Mapping[str, Any]) -> int:
    tokens = _count_tokens(payload.get("prompt"))
    messages = payload.get("messages")
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = [part.get("text") for part in content if isinstance(part, dict)]
        tokens += _count_tokens(content)
    return max(tokens, 1)


def _unit_vector(item: Any, dim: int) -> list[float]:
    """A deterministic vector for one input, so equal inputs embed equally."""
    rng = random.Random(hashlib.sha256(_dumps(item)).digest())
    vector = [rng.uniform(-1.0, 1.0) for _ in range(dim)]
    norm = sum(x * x for x in vector) ** 0.5 or 1.0
    return [x / norm for x in vector]
