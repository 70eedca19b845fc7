"""Whether a node is alive: one `GET /health`, asked the same way by every loop that waits on a node.

Three loops ask it: the health checker (every node, on its interval), a setup's health poll (the engine it just
started on a host) and llama-server's own start (`LlamaServerProcess.wait_ready`). Each keeps its own timing and
logging; the question is asked here, so that it is asked the strict way everywhere:

- redirects are never followed: a node that answers `/health` with a 3xx is not alive, and the gateway never
  goes where a node's answer points (it could point outside the endpoint allowlist);
- the session resolves host names through `AllowlistResolver`, so a name that resolves outside the allowlist
  (loopback, link-local, the metadata service) is refused when the connection is made;
- proxy environment variables are ignored, and at most `HEALTH_BODY_BYTES` of the answer are read.

`probe_models` asks a node which models it serves (`GET /v1/models`, a vLLM setup's last check) the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import aiohttp

from qiip_core._errors import safe_text
from qiip_core.nodes import EndpointPolicy
from qiip_core.upstream import AllowlistResolver, describe_client_error, is_local_exhaustion

__all__ = [
    "HEALTH_BODY_BYTES",
    "MODELS_BODY_BYTES",
    "HealthAnswer",
    "NoAnswer",
    "ProbeOutcome",
    "bounded_answer",
    "classify_health",
    "health_session",
    "probe_health",
    "probe_models",
    "read_head",
]

HEALTH_BODY_BYTES = 4096
"""At most this many bytes of a `/health` answer are read (llama-server's are under 100)."""

MODELS_BODY_BYTES = 1 << 20
"""At most this many bytes (1 MiB) of a `/v1/models` answer are read; a longer one is refused, not parsed."""


class ProbeOutcome(StrEnum):
    """How a node answered `GET /health`."""

    OK = "ok"
    """200: ready."""
    LOADING = "loading"
    """503 "Loading model" (llama-server): alive, not ready yet."""
    FAILED = "failed"
    """Anything else: an error status, a redirect, a timeout, a refused connection."""
    LOCAL_FAILURE = "local_failure"
    """The probe could not be made: the gateway itself is out of file descriptors. Never the node's failure."""


def classify_health(status_code: int, body: bytes) -> ProbeOutcome:
    """Classify a `/health` answer.

    Args:
        status_code: the HTTP status.
        body: the response body (llama-server answers `{"error":{"code":503,"message":"Loading model",
            "type":"unavailable_error"}}` while loading).
    """
    if status_code == 200:
        return ProbeOutcome.OK
    if status_code == 503:
        try:
            error = json.loads(body).get("error", {})
        except (ValueError, AttributeError):
            return ProbeOutcome.FAILED
        if isinstance(error, dict) and "loading" in str(error.get("message", "")).lower():
            return ProbeOutcome.LOADING
    return ProbeOutcome.FAILED


@dataclass(frozen=True, slots=True)
class HealthAnswer:
    """What one `GET /health` found.

    Attributes:
        outcome: the classified answer (`classify_health`), or `FAILED` / `LOCAL_FAILURE` when none came.
        status: the HTTP status; None when no answer came (`error` says why).
        body: the first `HEALTH_BODY_BYTES` bytes of the answer.
        error: the transport error (refused, reset, timed out: aiohttp's, `TimeoutError` or `OSError`) when no
            answer came, else None.
    """

    outcome: ProbeOutcome
    status: int | None = None
    body: bytes = b""
    error: Exception | None = None

    @property
    def alive(self) -> bool:
        """True when the node answered 200: ready for traffic."""
        return self.outcome is ProbeOutcome.OK


def health_session(
    *,
    policy: EndpointPolicy | None,
    timeout_s: float,
    connect_timeout_s: float | None = None,
    limit: int = 100,
    force_close: bool = False,
) -> aiohttp.ClientSession:
    """An aiohttp session for `probe_health`; the caller closes it (`async with`). Create it inside the event loop.

    Args:
        policy: the endpoint allowlist host names are resolved against (`AllowlistResolver`); None resolves
            without a check (IP-literal endpoints are never resolved: aiohttp connects to them as they are).
        timeout_s: the deadline of one probe, connect to last byte, in seconds.
        connect_timeout_s: the deadline of the connect alone, in seconds; None: within `timeout_s`.
        limit: at most this many connections at once.
        force_close: close each connection after its answer (no keep-alive).
    """
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=limit,
            force_close=force_close,
            resolver=AllowlistResolver(policy) if policy is not None else None,
        ),
        trust_env=False,
        timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s),
    )


async def probe_health(endpoint: str, *, session: aiohttp.ClientSession) -> HealthAnswer:
    """Ask `endpoint` once whether it is alive: `GET {endpoint}/health`, redirects not followed.

    Args:
        endpoint: the node's base URL, `http://host:port` (no trailing slash).
        session: the session to ask through (`health_session`: its timeout, allowlist resolver and pool).

    Returns:
        The answer; a transport failure is an answer too (`error` set), never raised.
    """
    try:
        async with session.get(endpoint + "/health", allow_redirects=False) as response:
            status, body = response.status, await read_head(response.content, HEALTH_BODY_BYTES)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        outcome = ProbeOutcome.LOCAL_FAILURE if is_local_exhaustion(exc) else ProbeOutcome.FAILED
        return HealthAnswer(outcome, error=exc)
    return HealthAnswer(classify_health(status, body), status=status, body=body)


async def read_head(content: aiohttp.StreamReader, limit: int) -> bytes:
    """Up to `limit` bytes of a body (`StreamReader.read(n)` may return fewer than are coming).

    Args:
        content: the response's body stream.
        limit: the most bytes to read.

    Returns:
        The first `limit` bytes of the body, or all of it when shorter.

    Raises:
        aiohttp.ClientError, TimeoutError, OSError: reading broke.
    """
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await content.read(limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


async def probe_models(endpoint: str, *, session: aiohttp.ClientSession) -> list[str]:
    """The model ids a node serves: `GET {endpoint}/v1/models`, asked as strictly as `probe_health`.

    Contract: the OpenAI list-models answer `{"object": "list", "data": [{"id": ...}, ...]}` (vLLM's and
    llama-server's); entries without a string `id` are skipped. Redirects are not followed, and at most
    `MODELS_BODY_BYTES` are read.

    Args:
        endpoint: the node's base URL, `http://host:port` (no trailing slash).
        session: the session to ask through (`health_session`: its timeout, allowlist resolver and pool).

    Returns:
        The served model ids, in the node's order.

    Raises:
        ValueError: no answer came, or it was not a 200 carrying that list; the message says which, in one line.
    """
    try:
        async with session.get(endpoint + "/v1/models", allow_redirects=False) as response:
            status, body = response.status, await read_head(response.content, MODELS_BODY_BYTES + 1)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise ValueError(f"no answer ({type(exc).__name__}: {exc})") from exc
    if status != 200:
        raise ValueError(f"HTTP {status}")
    if len(body) > MODELS_BODY_BYTES:
        raise ValueError(f"an answer over {MODELS_BODY_BYTES} bytes")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise ValueError("an answer that is not JSON") from None
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError("an answer without a `data` list")
    return [entry["id"] for entry in entries if isinstance(entry, dict) and isinstance(entry.get("id"), str)]


class NoAnswer(Exception):
    """A request gave no answer that can be read: the message says why in one escaped line (what the client library
    said, or an answer over the limit).

    Attributes:
        local: the gateway could not make the request (out of file descriptors): no fault of the server's.
    """

    def __init__(self, text: str, *, local: bool = False) -> None:
        super().__init__(text)
        self.local = local


async def bounded_answer(
    session: aiohttp.ClientSession, method: str, url: str, *, limit: int, body: Any = None
) -> tuple[int, bytes]:
    """One request whose answer is read to at most `limit` bytes, redirects not followed: the status and the body.

    Args:
        session: the session to ask through (`health_session`: the allowlist resolver).
        method: the HTTP method.
        url: the whole URL.
        limit: the most bytes of body taken, in bytes; a longer body is no answer.
        body: sent as JSON when not None.

    Raises:
        NoAnswer: the request or the read failed, or the body is longer than `limit`.
    """
    try:
        async with session.request(method, url, json=body, allow_redirects=False) as response:
            status, answer = response.status, await read_head(response.content, limit + 1)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise NoAnswer(safe_text(describe_client_error(exc), limit=300), local=is_local_exhaustion(exc)) from exc
    if len(answer) > limit:
        raise NoAnswer(f"answered over {limit} bytes")
    return status, answer
