"""Status faults: whole responses with any status and body, bodies without a declared length cut short, and
llama-server's 503 while it loads its model."""

from __future__ import annotations

import gzip as gzip_module
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tests.support.fault_backend._exchange import Behaviour, Exchange
from tests.support.fault_backend._payloads import dumps, error_body, lower_names, parse_json


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
        body = self.body if isinstance(self.body, bytes) else dumps(self.body)
        headers = {"content-type": "application/json"}
        if self.gzip:
            body = gzip_module.compress(body, mtime=0)
            headers["content-encoding"] = "gzip"
        headers.update(lower_names(self.headers))
        await exchange.send_response(self.status, body, headers)


@dataclass(frozen=True)
class UnframedJson(Behaviour):
    """A JSON answer without `Content-Length`: chunked, or ended by closing the connection, and maybe cut.

    Without a declared length, only the transport says where the body ends, so a cut can look like an end:
    a chunked body's last chunk, or a FIN on a close-delimited one.

    Attributes:
        body: a JSON value to serialise.
        chunked: chunked transfer encoding (one chunk); False ends the body by closing the connection.
        cut_after_bytes: send only this many bytes of the body, then end it as `reset` says.
        reset: end a cut body with a TCP RST instead of its normal end (the last chunk, or a FIN).
    """

    body: dict[str, Any] = field(default_factory=dict)
    chunked: bool = False
    cut_after_bytes: int | None = None
    reset: bool = False

    async def respond(self, exchange: Exchange) -> None:
        body = dumps(self.body)
        if self.cut_after_bytes is not None:
            body = body[: self.cut_after_bytes]
        await exchange.start_stream(200, {"content-type": "application/json"}, chunked=self.chunked)
        await exchange.send(body)
        if self.reset:
            exchange.reset()
            return
        await exchange.end_stream()


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
            body = error_body(self.status, f"Injected fault: status {self.status}.")
        else:
            body = self.body
        headers = dict(lower_names(self.headers))
        if isinstance(body, bytes) and parse_json(body) is None:
            headers.setdefault("content-type", "text/plain; charset=utf-8")
        await Json(self.status, body, headers).respond(exchange)


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
