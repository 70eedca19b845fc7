"""The one place that turns errors into HTTP answers, for the client API and the admin API alike.

Every error is a `QiipError` that carries its status, OpenAI error `code` and `param` (see the tree in
`qiip_core._errors`); `describe_error` adds what only HTTP needs: the OpenAI `type`, the response headers
and extra fields of the error object. The app registers one exception handler for `QiipError`
(`error_response`); the inference paths, served as plain ASGI, answer with `send_error`. Every body has
OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, so the `openai` library raises its usual
exceptions with our message.

Once a stream has started, errors are not HTTP answers any more: `sse_error_event` is what the relay sends
in-band, followed by `data: [DONE]`.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

from starlette.responses import Response
from starlette.types import Send

from qiip_core import (
    AuthError,
    DeploymentInvalid,
    FailoverExhausted,
    ManifestInvalid,
    PlanError,
    QiipError,
    UpstreamError,
)

__all__ = [
    "SSE_DONE",
    "TOO_DEEP",
    "ErrorAnswer",
    "RequestRefused",
    "body_too_large",
    "describe_error",
    "error_body",
    "error_response",
    "send_error",
    "sse_error_event",
]

SSE_DONE = b"data: [DONE]\n\n"

TOO_DEEP = "The request body is not valid JSON: it is nested too deeply."
"""The message for a JSON body whose nesting exceeds what the parser recurses through."""


class RequestRefused(QiipError):
    """A request the daemon refuses for its form (bad JSON, missing model, too large, an unknown path, …).

    Unlike the core's errors, one class covers every such refusal, so its status and code are the
    instance's (the class's are what a refusal without a more precise reason gets).

    Args:
        status: the HTTP status.
        message: a full sentence for the client.
        code: the OpenAI error `code`.
        param: the request field at fault, if any.
        type: the OpenAI error `type`.
        headers: extra response headers.
        extra: more fields for the error object (such as `violations`).
    """

    status = 400
    code = "invalid_request"

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        *,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
        self.type = type
        self.headers = headers or {}
        self.extra = extra or {}


def body_too_large(limit_bytes: int, setting: str) -> RequestRefused:
    """The refusal of a request body over its limit: 413 `request_too_large` (RFC 9110 §15.5.14), one wording for
    the client API, the admin API and the workers.

    Args:
        limit_bytes: the largest body accepted, in bytes.
        setting: the setting that sets it (`server.max_body_bytes`, `admin.max_body_bytes`).
    """
    return RequestRefused(
        413, f"The request body is larger than the limit of {limit_bytes} bytes ({setting}).", "request_too_large"
    )


class ErrorAnswer(NamedTuple):
    """What the client gets for an error: the parts of an HTTP answer, or of an in-band SSE error event."""

    status: int
    """The HTTP status."""
    body: bytes
    """The OpenAI error JSON."""
    headers: dict[str, str]
    """Headers to add to the answer."""


_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
"""OpenAI error types by status; any other status is an `invalid_request_error` below 500, else a `server_error`."""


def describe_error(exc: QiipError) -> ErrorAnswer:
    """The answer for an error: the one mapping, for both APIs and in-band stream errors.

    Args:
        exc: the error, with its status, code and param.

    Returns:
        The status, the OpenAI error body, and headers: `WWW-Authenticate` for a refused invoke token,
        `X-QIIP-Attempts` (and `X-QIIP-Failover: exhausted`) for a failed forward, `Retry-After` when the
        error knows when a retry may succeed.
    """
    status = exc.status
    headers: dict[str, str] = {}
    extra: dict[str, Any] | None = None
    if isinstance(exc, RequestRefused):
        kind, headers, extra = exc.type, exc.headers, exc.extra
    elif isinstance(exc, UpstreamError):
        kind = "upstream_error"
        if isinstance(exc, FailoverExhausted):
            headers = {"X-QIIP-Failover": "exhausted", "X-QIIP-Attempts": str(exc.attempts)}
        else:
            headers = {"X-QIIP-Attempts": str(exc.attempts)}
    else:
        kind = _TYPES.get(status) or ("invalid_request_error" if status < 500 else "server_error")
        if isinstance(exc, AuthError) and status == 401:
            headers = {"WWW-Authenticate": 'Bearer realm="qiip"'}
        elif isinstance(exc, PlanError | ManifestInvalid | DeploymentInvalid):
            extra = {"violations": [{"field": v.field, "message": v.message} for v in exc.violations]}
    if exc.retry_after_s is not None:
        # Whole seconds (RFC 9110 §10.2.3), rounded up, and never 0: a client must not retry in a busy loop.
        headers = {**headers, "Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
    return ErrorAnswer(status, error_body(exc.message, type=kind, code=exc.code, param=exc.param, extra=extra), headers)


def error_body(
    message: str, *, type: str, code: str | None, param: str | None = None, extra: dict[str, Any] | None = None
) -> bytes:
    """The OpenAI error JSON (`extra` adds fields to the error object)."""
    error = {"message": message, "type": type, "param": param, "code": code, **(extra or {})}
    return json.dumps({"error": error}).encode()


def error_response(exc: QiipError, *, headers: dict[str, str] | None = None) -> Response:
    """The HTTP answer for an error raised before anything was sent to the client: the app's exception
    handler for every `QiipError`."""
    status, body, extra = describe_error(exc)
    return Response(body, status_code=status, media_type="application/json", headers={**extra, **(headers or {})})


async def send_error(send: Send, exc: QiipError, request_id: str) -> None:
    """Send a complete error answer on a plain ASGI path (before anything else was sent).

    Args:
        send: the ASGI send channel.
        exc: the error.
        request_id: the request's `X-Request-Id`.
    """
    status, body, headers = describe_error(exc)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    raw.append((b"x-request-id", request_id.encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def sse_error_event(exc: QiipError) -> bytes:
    """One SSE event carrying the OpenAI error, for failures after a stream has started."""
    return b"data: " + describe_error(exc).body + b"\n\n"
