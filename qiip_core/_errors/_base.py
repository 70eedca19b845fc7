"""The core of the exception tree: the base class, and the errors of configuration, registries, routing,
forwarding and authentication (the tree is drawn in `qiip_core._errors`)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

__all__ = [
    "AuthError",
    "ConfigError",
    "EndpointError",
    "EndpointNotAllowed",
    "EndpointNotSupported",
    "FailoverExhausted",
    "ModelNotFound",
    "ModelOverloaded",
    "ModelUnavailable",
    "NoNodes",
    "NodeConflict",
    "NodeNotFound",
    "QiipError",
    "RegistryError",
    "RegistryUnavailable",
    "RoutingError",
    "TokenExpired",
    "TokenInvalid",
    "TokenNotFound",
    "TokenRequestInvalid",
    "TokenRevoked",
    "TokenScopeError",
    "TokenStoreUnavailable",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamTimeout",
    "UpstreamTransportError",
    "escape_controls",
    "safe_text",
]


class QiipError(Exception):
    """Base class of every error QIIP raises on purpose.

    Args:
        message: a full sentence saying what happened and, where it helps, what to do next.
    """

    status: int = 500
    """The HTTP status an API answers with when this error reaches it."""
    code: str = "internal_error"
    """The OpenAI-style error `code` of that answer."""
    param: str | None = None
    """The request field at fault, when there is one."""
    retry_after_s: float | None = None
    """When it is worth retrying, in seconds (the answer's `Retry-After`), when known."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(QiipError):
    """A setting is invalid. The message names the setting and what is allowed."""

    # Over HTTP, the one configuration that can fail is an attached profile's (its token file): a conflict
    # with the daemon's own configuration.
    status = 409
    code = "profile_invalid"


class EndpointError(QiipError):
    """An endpoint string cannot be used: no port, a path, userinfo, an unknown scheme, …

    Attributes:
        endpoint: the string as given.
    """

    status = 400
    code = "endpoint_not_allowed"
    param = "endpoint"

    def __init__(self, message: str, *, endpoint: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint


class EndpointNotAllowed(EndpointError):
    """A well-formed endpoint whose host, address or port is outside the configured allowlist."""


class RegistryError(QiipError):
    """The node registry refused or failed an operation."""

    status = 503
    code = "registry_error"


class NodeNotFound(RegistryError):
    """No node has this id.

    Attributes:
        node_id: the id asked for.
    """

    status = 404
    code = "node_not_found"
    param = "node_id"

    def __init__(self, node_id: str) -> None:
        super().__init__(f"No node is registered with id {node_id!r}.")
        self.node_id = node_id


class NodeConflict(RegistryError):
    """The node already exists, comes from a source that cannot change it, or its state forbids the change."""

    status = 409
    code = "conflict"


class RegistryUnavailable(RegistryError):
    """The registry's backend (state file, etcd) cannot be read or written right now."""

    status = 503
    code = "registry_unavailable"


class RoutingError(QiipError):
    """No node can take a request. Carries the HTTP status and OpenAI error code the client API answers with.

    Attributes:
        model: the model the request asked for.
        status: the HTTP status for the client.
        code: the OpenAI error `code`.
    """

    status = 503
    code = "no_nodes"

    def __init__(self, message: str, *, model: str) -> None:
        super().__init__(message)
        self.model = model


class NoNodes(RoutingError):
    """The registry holds no nodes at all (503 `no_nodes`)."""

    status = 503
    code = "no_nodes"


class ModelNotFound(RoutingError):
    """No node, in any state, serves the requested model (404 `model_not_found`)."""

    status = 404
    code = "model_not_found"
    param = "model"


class ModelUnavailable(RoutingError):
    """Nodes serve the model but none is eligible now: unhealthy, draining, or already tried (503)."""

    status = 503
    code = "model_unavailable"


class ModelOverloaded(RoutingError):
    """The model already has as many requests in flight at the gateway as `[admission]` allows: the request is
    shed before it reaches a node (429 by default, or 503; `code` model_overloaded, with `Retry-After`).

    Args:
        message: a full sentence for the client.
        model: the requested model.
        status: 429 or 503 (`admission.status`).
        reason: the bound that was reached: `max_in_flight` or `queue_per_slot`.
        retry_after_s: the answer's `Retry-After`, in seconds.
    """

    status = 429
    code = "model_overloaded"

    def __init__(self, message: str, *, model: str, status: int, reason: str, retry_after_s: float) -> None:
        super().__init__(message, model=model)
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s


class EndpointNotSupported(RoutingError):
    """Nodes serve the model, but none of them serves the requested API (embeddings on a chat model: 400)."""

    status = 400
    code = "endpoint_not_supported"
    param = "model"


class UpstreamError(QiipError):
    """Forwarding one request to one node failed before a byte reached the client.

    Attributes:
        node_id: the node that failed, or None when no node was tried.
        status: the HTTP status to answer with (502, 504, or the node's own 5xx).
        code: the OpenAI error `code`.
        retryable: whether another node may be tried (connect errors, timeouts, 5xx).
        detail: what the node or the transport said (an error text, an address), never shown to clients.
        local: the gateway's own failure (out of file descriptors), not the node's: counted against no node.
        attempts: nodes tried for the request, this one included (`X-QIIP-Attempts`; set by the forwarder).
    """

    status = 502
    code = "backend_transport_error"
    retryable: bool = True
    attempts: int = 1
    local: bool = False

    def __init__(self, message: str, *, node_id: str | None, detail: str | None = None) -> None:
        super().__init__(message)
        self.node_id = node_id
        self.detail = detail

    @property
    def log_text(self) -> str:
        """The message with what the node or the transport said (`detail`), for logs and the admin API only:
        secrets redacted and control characters escaped (`safe_text`). Clients get `message`, the gateway's
        own words, which never quote a node."""
        if not self.detail:
            return self.message
        return f"{self.message} ({safe_text(self.detail)})"


class UpstreamConnectError(UpstreamError):
    """The TCP or TLS connection to the node failed (502 `backend_unavailable`)."""

    status = 502
    code = "backend_unavailable"


class UpstreamTimeout(UpstreamError):
    """Connect, first-byte, generation, inter-chunk idle, pool or deadline timeout (504 `backend_timeout`).

    Attributes:
        request_sent: True when the node had received the whole request before the time ran out: it was
            working on it, so sending it to another node would repeat that work (see
            `routing.retry_after_timeout`).
    """

    status = 504
    code = "backend_timeout"

    def __init__(
        self, message: str, *, node_id: str | None, request_sent: bool = False, detail: str | None = None
    ) -> None:
        super().__init__(message, node_id=node_id, detail=detail)
        self.request_sent = request_sent


class UpstreamTransportError(UpstreamError):
    """Any other transport failure: reset, protocol error, truncated response (502)."""

    status = 502
    code = "backend_transport_error"


class UpstreamStatusError(UpstreamError):
    """The node answered with a 5xx status. The status and the start of its body are kept.

    Its `status` is the node's, and its `code` that status as a string (per instance).

    Attributes:
        body: the node's response body, at most the first 4 KiB.
    """

    def __init__(
        self, message: str, *, node_id: str | None, status: int, body: bytes, detail: str | None = None
    ) -> None:
        super().__init__(message, node_id=node_id, detail=detail)
        self.status = status
        self.code = str(status)
        self.body = body


class FailoverExhausted(UpstreamError):
    """Every attempt failed with a retryable error.

    The status is the last failure's; the code is `failover_exhausted`.

    Attributes:
        attempts: how many nodes were tried (the first try counts).
        last: the last attempt's error.
        failures: every attempt's error, oldest first.
    """

    code = "failover_exhausted"

    def __init__(self, *, attempts: int, last: UpstreamError, failures: list[UpstreamError] | None = None) -> None:
        noun = "attempt" if attempts == 1 else "attempts"
        super().__init__(
            f"The request failed on {attempts} {noun}; the last: {last.message}",
            node_id=last.node_id,
            detail=last.detail,
        )
        self.attempts = attempts
        self.last = last
        self.failures = failures if failures is not None else [last]
        self.status = last.status


class AuthError(QiipError):
    """An invoke token was refused, or the token store failed. Carries the HTTP status and OpenAI error code.

    Messages never contain a secret, so they can be sent to the client and logged as they are.

    Attributes:
        token_id: the token concerned, when one is known (None for an unknown secret).
        status: the HTTP status for the client.
        code: the OpenAI error `code`.
    """

    status = 401
    code = "invalid_api_key"

    def __init__(self, message: str, *, token_id: str | None = None) -> None:
        super().__init__(message)
        self.token_id = token_id


class TokenInvalid(AuthError):
    """No token has the presented secret, or the secret is not shaped like one (401 `invalid_api_key`)."""

    status = 401
    code = "invalid_api_key"


class TokenExpired(AuthError):
    """The token's `expires_at` has passed (401 `token_expired`)."""

    status = 401
    code = "token_expired"


class TokenRevoked(AuthError):
    """The token was revoked by an operator (401 `token_revoked`)."""

    status = 401
    code = "token_revoked"


class TokenScopeError(AuthError):
    """The token is bound to another model than the one requested (403 `model_not_allowed`).

    Attributes:
        model: the model the request asked for.
    """

    status = 403
    code = "model_not_allowed"

    def __init__(self, message: str, *, token_id: str, model: str) -> None:
        super().__init__(message, token_id=token_id)
        self.model = model


class TokenNotFound(AuthError):
    """No live or revoked token has this id (404 `token_not_found`); raised by admin lookups."""

    status = 404
    code = "token_not_found"

    def __init__(self, token_id: str) -> None:
        super().__init__(f"No invoke token has id {token_id!r}.", token_id=token_id)


class TokenRequestInvalid(AuthError):
    """A token cannot be created as asked: its ttl, model or description is out of bounds (400)."""

    status = 400
    code = "invalid_token_request"


class TokenStoreUnavailable(AuthError):
    """The token store's backend (the token file, etcd) cannot be read or written right now (503)."""

    status = 503
    code = "token_store_unavailable"


_SECRETS = re.compile(
    r"(?i)((?:authorization|api[-_]?key|token|password)[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|basic)\s+)?)[^\s\"',;]+"
    r"|(\b(?:bearer|basic)\s+)[A-Za-z0-9._~+/=-]+"
    r"|(\b[a-z][a-z0-9+.-]*://)[^/@\s\"']+(?=@)"
)
"""Credentials as they appear in echoed headers, error texts and URLs: `Bearer <token>`, `authorization: <...>`,
`https://user:password@host` (the userinfo goes)."""

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
"""Characters that end a line or drive a terminal: C0 and C1 controls, DEL, and Unicode's line and paragraph
separators."""


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    """`text` with every control character escaped as `safe_text` escapes it, and nothing else changed."""
    return _CONTROL.sub(_escaped, text)


def safe_text(text: str, *, limit: int = 500) -> str:
    """`text` from a node, a transport or a client, fit for a log line or the admin API: credentials redacted,
    control characters (a newline would forge a log line, an escape sequence would drive the reader's terminal)
    escaped as `\\xNN` (`\\uNNNN` for the line and paragraph separators), at most `limit` characters.

    Args:
        text: the untrusted text.
        limit: the longest result, in characters.
    """
    redacted = _SECRETS.sub(lambda m: (m.group(1) or m.group(2) or m.group(3)) + "[redacted]", text)
    escaped = escape_controls(redacted)
    return escaped if len(escaped) <= limit else escaped[:limit] + "…"
