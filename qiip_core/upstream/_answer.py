"""A node's answer before the gateway commits to it: the headers it relays, the reason in an error answer, a body
read whole (or its start), and whether a body without a declared length is whole JSON. `_response` commits to the
answer with these."""

from __future__ import annotations

import json
import zlib

from qiip_core._errors import safe_text
from qiip_core.upstream._http11 import NodeResponse

__all__ = [
    "DECODABLE",
    "ERROR_BODY_BYTES",
    "HOP_BY_HOP_HEADERS",
    "buffer",
    "node_error_reason",
    "read_at_most",
    "relay_headers",
    "whole_json",
]

HOP_BY_HOP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"host",
    }
)
"""Headers that describe one connection, never relayed in either direction."""

_GATEWAY_HEADERS = frozenset({b"server", b"date", b"x-request-id", b"x-qiip-node", b"x-accel-buffering"})
"""Response headers the gateway sets itself; the node's are dropped so the client never sees two."""

_STREAM_HEADERS = frozenset({b"content-encoding", b"cache-control"})
"""Dropped from decoded event streams: the gateway relays them decoded and sets its own cache policy."""

DECODABLE = {"identity": 0, "gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""Content encodings an event stream may come in, with the `wbits` that decodes each."""

ERROR_BODY_BYTES = 4096
"""How much of a 5xx answer's body is kept for the error message."""


_REASON_CHARS = 200
"""The most characters of a node's own error message a client is shown."""


def node_error_reason(body: bytes) -> str | None:
    """The reason a node gave in an error answer, when its body says one in a shape QIIP knows.

    Shapes: the OpenAI error `{"error": {"message": "..."}}` (vLLM, llama-server, Ollama's `/v1` routes) and
    Ollama's native `{"error": "..."}` (`unable to load full model on GPU`).

    Args:
        body: the start of the answer's body (at most 4 KiB).

    Returns:
        The message, secrets redacted, control characters escaped, cut to 200 characters; None when the body is
        not one of those shapes. It is for logs and the admin API (the error's `detail`), never for clients.
    """
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    error = data.get("error") if isinstance(data, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    if not isinstance(message, str) or not message.strip():
        return None
    return safe_text(message.strip().rstrip("."), limit=_REASON_CHARS)


def relay_headers(response: NodeResponse, *, decoded: bool) -> list[tuple[bytes, bytes]]:
    headers = []
    for name, value in response.raw_headers:
        lower = name.lower()
        if (
            lower in HOP_BY_HOP_HEADERS
            or lower in _GATEWAY_HEADERS
            # A node's CORS answer is not the gateway's policy.
            or lower.startswith(b"access-control-")
            or (decoded and lower in _STREAM_HEADERS)
        ):
            continue
        headers.append((lower, value))
    return headers


async def read_at_most(response: NodeResponse, limit: int) -> bytes:
    body = bytearray()
    while len(body) < limit:
        chunk = await response.readany()
        if not chunk:
            break
        body += chunk
    return bytes(body[:limit])


def whole_json(body: bytes, encoding: str) -> bool:
    """Whether `body` (in its content `encoding`) is one whole JSON value; True when the encoding is not one
    QIIP decodes (brotli, zstd: it cannot tell, and relays the body as it came)."""
    if encoding != "identity":
        wbits = DECODABLE.get(encoding)
        if wbits is None:
            return True
        decoder = zlib.decompressobj(wbits)
        try:
            body = decoder.decompress(body)
        except zlib.error:
            return False
        if not decoder.eof:
            return False
    try:
        json.loads(body)
    except (ValueError, RecursionError):
        return False
    return True


async def buffer(response: NodeResponse, limit: int) -> tuple[bytes, bool]:
    """Read up to `limit` bytes; returns (bytes, whole body read)."""
    if response.whole:
        # The usual answer: its last byte came with its headers.
        whole = await response.readany()
        return whole, len(whole) <= limit
    body = bytearray()
    while True:
        chunk = await response.readany()
        if not chunk:
            return bytes(body), True
        body += chunk
        if len(body) > limit:
            return bytes(body), False
