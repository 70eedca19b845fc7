"""The one exception tree of QIIP.

Every error that crosses a package boundary is a `QiipError`. Third-party exceptions (aiohttp, httpx,
etcd3gw, asyncssh, OS errors) are translated where they are raised, so callers never catch library types.

Every class carries the HTTP answer it becomes when it reaches an API: `status`, the OpenAI-style `code`
and, when one request field is at fault, `param` (class attributes; a few are set per instance, noted
below). The daemon maps them with one exception handler for the client and the admin API
(`qiip_proxy._errors`), and a test walks every subclass to check that none falls through to a 500.

```
QiipError                       (500 internal_error: only for a bare QiipError, such as a CLI's own)
├── ConfigError                 409 profile_invalid: a setting is invalid; start-up stops (over HTTP: an
│   │                           attached profile whose token file cannot be used)
│   └── ThemeFileError          422 invalid_theme: a console theme file (qiip_tui; `.path`)
├── EndpointError               400 endpoint_not_allowed (param endpoint): an endpoint string is malformed
│   └── EndpointNotAllowed      well-formed, but outside the allowlist
├── RegistryError               503 registry_error: the node registry refused or failed an operation
│   ├── NodeNotFound            404 node_not_found (param node_id)
│   ├── NodeConflict            409 conflict: the node exists, or its state forbids the change
│   └── RegistryUnavailable     503 registry_unavailable: the backend (state file, etcd) cannot be reached
├── RoutingError                no node can take the request (`.model`)
│   ├── NoNodes                 503 no_nodes
│   ├── ModelNotFound           404 model_not_found (param model)
│   ├── ModelUnavailable        503 model_unavailable
│   └── EndpointNotSupported    400 endpoint_not_supported (param model)
├── UpstreamError               forwarding to a node failed (`.node_id`, `.retryable`)
│   ├── UpstreamConnectError    502 backend_unavailable
│   ├── UpstreamTimeout         504 backend_timeout (`.request_sent`)
│   ├── UpstreamTransportError  502 backend_transport_error
│   ├── UpstreamStatusError     the node answered 5xx: its status, code "<status>" (per instance; `.body`)
│   └── FailoverExhausted       the last attempt's status, failover_exhausted (`.attempts`, `.last`)
├── EngineError                 503 engine_error: installing, launching or verifying an engine failed
│   ├── EngineNotInstalled      503 engine_not_installed
│   ├── DigestMismatch          502 digest_mismatch (`.expected`, `.actual`)
│   ├── EngineBuildError        503 engine_build_failed
│   ├── EngineLaunchError       503 engine_launch_failed (`.log_tail`)
│   ├── ModelFileError          422 invalid_model_file: not a GGUF llama-server can load (`.path`); also a
│   │                           ValueError
│   ├── VerificationError       502 verification_failed: the running server differs from its plan
│   └── RelaunchError           503 relaunch_failed (`.rolled_back`)
├── ProvisioningError           502 provisioning_failed: a setup, teardown or power step failed (`.host`, `.step`)
│   ├── HostNotAllowed          400 host_not_allowed (param hostname): outside the allowlist; nothing was done
│   ├── HostBusy                409 host_busy: another operation holds the host's lease
│   ├── TooManySetups           429 too_many_setups: the concurrent-setup limit is reached
│   ├── SshError                502 ssh_error: refused, unreachable, authentication, a remote command failed
│   │   ├── HostKeyMismatch     502 host_key_mismatch: the host's key is not the known one
│   │   └── RemoteTimeout       504 remote_timeout: a remote command passed its total or inactivity deadline
│   └── RedfishError            502 redfish_error: the BMC refused, failed or did not answer (`.bmc_status`)
│       ├── PowerNotConfigured  409 power_not_configured: no `redfish.bmc_url_template`
│       ├── BmcUnreachable      502 bmc_unreachable: refused, no route, a name that does not resolve, TLS
│       ├── BmcUnauthorized     502 bmc_unauthorized: the BMC refused the credentials (401, 403)
│       ├── BmcTimeout          504 bmc_timeout: no answer within `redfish.timeout_s`
│       ├── SystemNotFound      404 system_not_found: the BMC has no (single) computer system
│       └── ResetNotSupported   409 reset_not_supported: the system does not offer this reset type
├── PlanError                   422 invalid_policy: a sizing cannot be planned (`.violations`, if any)
├── ModelStoreError             503 model_store_error: the catalog, a download or an acquisition failed
│   ├── ArtifactNotFound        404 artifact_not_found: no catalog generation has this id (`.artifact_id`)
│   ├── RevisionNotFound        404 revision_not_found: no registered manifest has this id
│   ├── ManifestInvalid         422 invalid_manifest: a manifest breaks a rule (`.violations`)
│   ├── DownloadFailed          502 download_failed: the hub refused or the transfer broke
│   ├── SourceNotAllowed        403 source_not_allowed: a URL (or a redirect) outside the allowlist, or with
│   │                           credentials in it
│   ├── ObjectMismatch          422 object_mismatch: the bytes' SHA-256 or size differ from the manifest's
│   ├── AcquisitionPaused       409 acquisition_paused: paused at a durable offset; acquire again to resume
│   └── RevisionInUse           409 revision_in_use: a node serves it, or another acquisition holds it
├── AuthError                   an invoke token was refused, or the token store failed (`.token_id`)
│   ├── TokenInvalid            401 invalid_api_key: no token has this secret, or it is malformed
│   ├── TokenExpired            401 token_expired
│   ├── TokenRevoked            401 token_revoked
│   ├── TokenScopeError         403 model_not_allowed: the token is bound to another model
│   ├── TokenNotFound           404 token_not_found: no token has this id (admin lookups)
│   ├── TokenRequestInvalid     400 invalid_token_request: a ttl, model or description out of bounds
│   └── TokenStoreUnavailable   503 token_store_unavailable: the token file or etcd cannot be used
├── ClientError                 502 daemon_error: a running daemon could not be used (qiip_core.client)
│   ├── DaemonUnreachable       502 daemon_unreachable: nothing answers at its URL
│   ├── Unauthorized            401 unauthorized: it refused the admin credentials
│   ├── NotADaemon              502 not_a_daemon: something else answers there
│   └── ApiError                the daemon's own error answer: its status and code (per instance)
└── RequestRefused              the daemon refuses a request's form itself (qiip_proxy; per instance:
    │                           400 invalid_json, 413 request_too_large, 404 not_found, …)
    └── AdminError              an admin API refusal (401 unauthorized, 415, 422 invalid_node, …)
```

`ThemeFileError`, the client's errors and the daemon's refusals live with the package that raises them;
this module holds the core's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from qiip_core._violation import Violation

__all__ = [
    "SystemNotFound",
    "ResetNotSupported",
    "PowerNotConfigured",
    "BmcUnreachable",
    "BmcUnauthorized",
    "BmcTimeout",
    "AcquisitionPaused",
    "AuthError",
    "ConfigError",
    "DigestMismatch",
    "EndpointError",
    "EndpointNotAllowed",
    "EndpointNotSupported",
    "EngineBuildError",
    "EngineError",
    "EngineLaunchError",
    "EngineNotInstalled",
    "HostBusy",
    "HostKeyMismatch",
    "HostNotAllowed",
    "FailoverExhausted",
    "ArtifactNotFound",
    "DownloadFailed",
    "ManifestInvalid",
    "ModelFileError",
    "ModelNotFound",
    "ModelStoreError",
    "ObjectMismatch",
    "RevisionInUse",
    "RevisionNotFound",
    "SourceNotAllowed",
    "ModelUnavailable",
    "NoNodes",
    "NodeConflict",
    "NodeNotFound",
    "PlanError",
    "ProvisioningError",
    "QiipError",
    "RedfishError",
    "RegistryError",
    "RegistryUnavailable",
    "RelaunchError",
    "RemoteTimeout",
    "RoutingError",
    "SshError",
    "TokenExpired",
    "TokenInvalid",
    "TokenNotFound",
    "TokenRequestInvalid",
    "TokenRevoked",
    "TokenScopeError",
    "TokenStoreUnavailable",
    "TooManySetups",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamTimeout",
    "UpstreamTransportError",
    "VerificationError",
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


class EngineError(QiipError):
    """Installing, launching or verifying an inference engine failed."""

    status = 503
    code = "engine_error"


class EngineNotInstalled(EngineError):
    """The engine binary is not installed; the message says which command installs it."""

    code = "engine_not_installed"


class DigestMismatch(EngineError):
    """A downloaded artifact's SHA-256 differs from the pinned digest. Nothing was extracted or published.

    Attributes:
        expected: the pinned hex digest.
        actual: the digest of what was downloaded.
    """

    status = 502
    code = "digest_mismatch"

    def __init__(self, message: str, *, expected: str, actual: str) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class EngineBuildError(EngineError):
    """Building the engine from source failed; the previous install, if any, is untouched."""

    code = "engine_build_failed"


class EngineLaunchError(EngineError):
    """The engine process did not become healthy. The message carries the tail of its log.

    Attributes:
        log_tail: the last lines the process wrote.
    """

    code = "engine_launch_failed"

    def __init__(self, message: str, *, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


class ModelFileError(EngineError, ValueError):
    """A model file cannot be served: missing, not a GGUF, truncated, a non-first shard, a shard missing.

    It is also a `ValueError`, which is what reading a bad file raised before it had a class of its own.

    Attributes:
        path: the file the message is about.
    """

    status = 422
    code = "invalid_model_file"

    def __init__(self, message: str, *, path: Path) -> None:
        super().__init__(message)
        self.path = path


class VerificationError(EngineError):
    """A running llama-server differs from the plan it was launched from. Treat the node as failed and stop it.

    Attributes:
        field: what differed, such as `slots` or `cache_type_k`.
        expected: the planned value.
        actual: what the server reported or logged (None when it reported nothing).
    """

    status = 502
    code = "verification_failed"

    def __init__(self, message: str, *, field: str, expected: object, actual: object) -> None:
        super().__init__(message)
        self.field = field
        self.expected = expected
        self.actual = actual


class RelaunchError(EngineError):
    """Relaunching a llama.cpp node with a new sizing failed.

    Attributes:
        rolled_back: True when the previous sizing runs again (the node can serve); False when the server
            is down and only teardown is left (`relaunch_failed`).
    """

    code = "relaunch_failed"

    def __init__(self, message: str, *, rolled_back: bool) -> None:
        super().__init__(message)
        self.rolled_back = rolled_back


class ProvisioningError(QiipError):
    """A provisioning operation (setup, teardown, power) failed on `.host`, in `.step` (None: before any)."""

    status = 502
    code = "provisioning_failed"

    def __init__(self, message: str, *, host: str, step: str | None = None) -> None:
        super().__init__(message)
        self.host = host
        self.step = step


class HostNotAllowed(ProvisioningError):
    """The host name is malformed or outside the allowlist (400); nothing was powered or contacted."""

    status = 400
    code = "host_not_allowed"
    param = "hostname"


class HostBusy(ProvisioningError):
    """Another operation, on this gateway or another sharing etcd, holds the host's lease (409)."""

    status = 409
    code = "host_busy"


class TooManySetups(ProvisioningError):
    """The concurrent-setup limit (`provisioning.max_concurrent_setups`) is reached (429)."""

    status = 429
    code = "too_many_setups"


class SshError(ProvisioningError):
    """SSH to the host failed: refused, unreachable, authentication, a lost connection, a failing command."""

    code = "ssh_error"


class HostKeyMismatch(SshError):
    """The host's SSH key is not the one in the known-hosts file (or the host is unknown in strict mode)."""

    code = "host_key_mismatch"


class RemoteTimeout(SshError):
    """A remote command passed its total or inactivity deadline; its process group was stopped (504)."""

    status = 504
    code = "remote_timeout"


class RedfishError(ProvisioningError):
    """A BMC refused, failed or did not answer a Redfish request (`.bmc_status`: its HTTP status, or None)."""

    code = "redfish_error"

    def __init__(self, message: str, *, host: str, bmc_status: int | None = None) -> None:
        super().__init__(message, host=host, step="powering_on")
        self.bmc_status = bmc_status


class PowerNotConfigured(RedfishError):
    """No BMC is configured (`redfish.bmc_url_template` is unset), so no power action is possible (409)."""

    status = 409
    code = "power_not_configured"


class BmcUnreachable(RedfishError):
    """The BMC cannot be reached: the connection is refused, its name does not resolve, TLS fails (502)."""

    code = "bmc_unreachable"


class BmcUnauthorized(RedfishError):
    """The BMC refused the credentials (401) or the user's rights (403) (502: the gateway's, not the caller's)."""

    code = "bmc_unauthorized"


class BmcTimeout(RedfishError):
    """The BMC did not answer within `redfish.timeout_s` (504)."""

    status = 504
    code = "bmc_timeout"


class SystemNotFound(RedfishError):
    """The BMC lists no computer system, several, or not the one asked for (404)."""

    status = 404
    code = "system_not_found"


class ResetNotSupported(RedfishError):
    """The computer system does not offer the reset type (`ResetType@Redfish.AllowableValues`) (409)."""

    status = 409
    code = "reset_not_supported"


class PlanError(QiipError):
    """A llama.cpp sizing cannot be planned: the policy is invalid, nothing fits, or no usable device exists.

    Attributes:
        violations: for an invalid policy, every rule it breaks (field and sentence); empty otherwise.
    """

    status = 422
    code = "invalid_policy"

    def __init__(self, message: str, *, violations: Sequence[Violation] = ()) -> None:
        super().__init__(message)
        self.violations = tuple(violations)


class ModelStoreError(QiipError):
    """The model catalog, a hub download or a manifest acquisition failed."""

    status = 503
    code = "model_store_error"


class ArtifactNotFound(ModelStoreError):
    """No GGUF generation of the catalog has this `artifact_id`."""

    status = 404
    code = "artifact_not_found"
    param = "artifact_id"

    def __init__(self, artifact_id: str, cache_dir: Path | str, *, message: str | None = None) -> None:
        super().__init__(
            message
            or f"No GGUF generation with artifact_id {artifact_id} is in the Hugging Face cache {cache_dir}; "
            "`qiip model list` shows the ones there."
        )
        self.artifact_id = artifact_id


class RevisionNotFound(ModelStoreError):
    """No registered manifest has this revision id."""

    status = 404
    code = "revision_not_found"


class ManifestInvalid(ModelStoreError):
    """A model manifest breaks a rule: each violation names the field and the rule."""

    status = 422
    code = "invalid_manifest"

    def __init__(self, message: str, *, violations: Sequence[Violation] = ()) -> None:
        super().__init__(message)
        self.violations = tuple(violations)


class DownloadFailed(ModelStoreError):
    """The hub refused a download (no such repository, revision or file; no access) or the transfer broke."""

    status = 502
    code = "download_failed"


class SourceNotAllowed(ModelStoreError):
    """An acquisition URL, or a redirect it led to, is not HTTPS on an allowed host, or carries credentials."""

    status = 403
    code = "source_not_allowed"


class ObjectMismatch(ModelStoreError):
    """The acquired bytes differ from the manifest (SHA-256 or size): the object was discarded."""

    status = 422
    code = "object_mismatch"


class AcquisitionPaused(ModelStoreError):
    """An acquisition stopped because it was paused; its offset is durable and the next one resumes there."""

    status = 409
    code = "acquisition_paused"


class RevisionInUse(ModelStoreError):
    """The revision cannot change now: a node serves it, or another acquisition of it runs."""

    status = 409
    code = "revision_in_use"


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
)
"""Credentials as they appear in echoed headers and error texts: `Bearer <token>`, `authorization: <...>`."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def safe_text(text: str, *, limit: int = 500) -> str:
    """`text` from a node or a transport, fit for a log line or the admin API: credentials redacted, control
    characters (a newline would forge a log line) escaped as `\\xNN`, at most `limit` characters.

    Args:
        text: the untrusted text.
        limit: the longest result, in characters.
    """
    redacted = _SECRETS.sub(lambda m: (m.group(1) or m.group(2)) + "[redacted]", text)
    escaped = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", redacted)
    return escaped if len(escaped) <= limit else escaped[:limit] + "…"
