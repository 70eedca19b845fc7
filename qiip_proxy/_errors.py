"""The one place that turns errors into HTTP answers on the client API.

Every error body has OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, so the `openai`
library raises its usual exceptions with our message. Once a stream has started, errors are not HTTP
answers any more: `sse_error_event` is what the relay sends in-band, followed by `data: [DONE]`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response

from qiip_core import AuthError, FailoverExhausted, QiipError, RoutingError, UpstreamError

__all__ = ["SSE_DONE", "TOO_DEEP", "ClientError", "describe_error", "error_body", "error_response", "sse_error_event"]

SSE_DONE = b"data: [DONE]\n\n"

TOO_DEEP = "The request body is not valid JSON: it is nested too deeply."
"""The message for a JSON body whose nesting exceeds what the parser recurses through."""


@dataclass
class ClientError(Exception):
    """A request the gateway refuses itself (bad JSON, missing model, too large, …).

    Attributes:
        status: the HTTP status.
        message: a full sentence for the client.
        code: the OpenAI error `code`.
        param: the request field at fault, if any.
        type: the OpenAI error `type`.
        headers: extra response headers.
        extra: more fields for the error object (such as `violations`).
    """

    status: int
    message: str
    code: str
    param: str | None = None
    type: str = "invalid_request_error"
    headers: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def error_body(
    message: str, *, type: str, code: str | None, param: str | None = None, extra: dict[str, Any] | None = None
) -> bytes:
    """The OpenAI error JSON (`extra` adds fields to the error object)."""
    error = {"message": message, "type": type, "param": param, "code": code, **(extra or {})}
    return json.dumps({"error": error}).encode()


def describe_error(exc: QiipError | ClientError) -> tuple[int, str, str | None, str | None, dict[str, str]]:
    """(status, OpenAI type, code, param, extra headers) for an error: the one mapping table."""
    if isinstance(exc, ClientError):
        return exc.status, exc.type, exc.code, exc.param, exc.headers
    if isinstance(exc, AuthError):
        if exc.status == 401:
            return 401, "authentication_error", exc.code, None, {"WWW-Authenticate": 'Bearer realm="qiip"'}
        kind = {403: "permission_error"}.get(
            exc.status, "invalid_request_error" if exc.status < 500 else "server_error"
        )
        return exc.status, kind, exc.code, None, {}
    if isinstance(exc, RoutingError):
        if exc.status < 500:
            return exc.status, "invalid_request_error", exc.code, "model", {}
        return exc.status, "service_unavailable_error", exc.code, None, {}
    if isinstance(exc, FailoverExhausted):
        headers = {"X-QIIP-Failover": "exhausted", "X-QIIP-Attempts": str(exc.attempts)}
        return exc.status, "upstream_error", exc.code, None, headers
    if isinstance(exc, UpstreamError):
        return exc.status, "upstream_error", exc.code, None, {"X-QIIP-Attempts": "1"}
    return 500, "server_error", "internal_error", None, {}


def error_response(exc: QiipError | ClientError, *, headers: dict[str, str] | None = None) -> Response:
    """The HTTP answer for an error raised before anything was sent to the client."""
    status, kind, code, param, extra = describe_error(exc)
    fields = exc.extra if isinstance(exc, ClientError) else None
    return Response(
        error_body(exc.message, type=kind, code=code, param=param, extra=fields),
        status_code=status,
        media_type="application/json",
        headers={**extra, **(headers or {})},
    )


def sse_error_event(exc: QiipError) -> bytes:
    """One SSE event carrying the OpenAI error, for failures after a stream has started."""
    _, kind, code, param, _ = describe_error(exc)
    return b"data: " + error_body(exc.message, type=kind, code=code, param=param) + b"\n\n"
