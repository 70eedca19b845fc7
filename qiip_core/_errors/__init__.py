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
│   ├── ModelOverloaded         429 (or 503, per instance) model_overloaded: shed by `[admission]` (`.reason`)
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
│   ├── HostNotFound            404 host_not_found (param hostname): the name does not resolve
│   ├── HostReserved            400 host_reserved (param hostname): QUADS reserves the host within the lookahead
│   ├── HostBusy                409 host_busy: another operation holds the host's lease
│   ├── LeaseLost               409 lease_lost: the operation's lease is gone or a newer generation holds the host
│   ├── SetupInvalid            400 invalid_setup (param per instance): a setup's body breaks a rule, found
│   │                           before any power or SSH work (or, for what only the host knows, before the bundle)
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
├── LlmfitError                 502 llmfit_failed: installing or running llmfit on a host failed, or its output
│   │                           is not `recommend --json`'s (`.host`)
│   └── LlmfitNotInstalled      503 llmfit_not_installed: the gateway's environment lacks the pinned binary
├── QuadsUnavailable            503 quads_unavailable: QUADS is configured but cannot be read
├── DeploymentError             503 deployment_error: a deployment could not be read, written or changed
│   ├── DeploymentInvalid       422 invalid_deployment: the spec breaks a rule (`.violations`, param the first)
│   ├── DeploymentNotFound      404 deployment_not_found (param name)
│   └── DeploymentConflict      409 conflict: a stale generation, a taken name, a deployment being deleted
├── HostPoolError               503 host_pool_error: the host pool could not be read or changed
│   └── HostNotInPool           404 host_not_in_pool (param name)
├── StateError                  503 state_error: the state could not be backed up, restored or moved
│   ├── BackupInvalid           422 invalid_backup: truncated, tampered, a newer format, not a QIIP backup
│   │                           (`.reason`); nothing was changed
│   └── StateConflict           409 state_conflict: the target holds state (no `replace`), a provisioning
│                               operation runs, or the state changed during the restore
├── PlanError                   422 invalid_policy: a sizing cannot be planned (`.violations`, if any)
├── ModelStoreError             503 model_store_error: the catalog, a download or an acquisition failed
│   ├── ArtifactNotFound        404 artifact_not_found: no catalog generation has this id (`.artifact_id`)
│   ├── ArtifactIdInvalid       422 invalid_artifact_id: not 8 to 64 hexadecimal characters (a prefix or a whole id)
│   ├── ArtifactAmbiguous       422 ambiguous_artifact_id: a prefix of several ids (`.matches`)
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

from qiip_core._errors._base import (
    AuthError,
    ConfigError,
    EndpointError,
    EndpointNotAllowed,
    EndpointNotSupported,
    FailoverExhausted,
    ModelNotFound,
    ModelOverloaded,
    ModelUnavailable,
    NodeConflict,
    NodeNotFound,
    NoNodes,
    QiipError,
    RegistryError,
    RegistryUnavailable,
    RoutingError,
    TokenExpired,
    TokenInvalid,
    TokenNotFound,
    TokenRequestInvalid,
    TokenRevoked,
    TokenScopeError,
    TokenStoreUnavailable,
    UpstreamConnectError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamTransportError,
    escape_controls,
    safe_text,
)
from qiip_core._errors._deployments import (
    DeploymentConflict,
    DeploymentError,
    DeploymentInvalid,
    DeploymentNotFound,
    HostNotInPool,
    HostPoolError,
)
from qiip_core._errors._operations import (
    AcquisitionPaused,
    ArtifactAmbiguous,
    ArtifactIdInvalid,
    ArtifactNotFound,
    BmcTimeout,
    BmcUnauthorized,
    BmcUnreachable,
    DigestMismatch,
    DownloadFailed,
    EngineBuildError,
    EngineError,
    EngineLaunchError,
    EngineNotInstalled,
    HostBusy,
    HostKeyMismatch,
    HostNotAllowed,
    HostNotFound,
    HostReserved,
    LeaseLost,
    LlmfitError,
    LlmfitNotInstalled,
    ManifestInvalid,
    ModelFileError,
    ModelStoreError,
    ObjectMismatch,
    PlanError,
    PowerNotConfigured,
    ProvisioningError,
    QuadsUnavailable,
    RedfishError,
    RelaunchError,
    RemoteTimeout,
    ResetNotSupported,
    RevisionInUse,
    RevisionNotFound,
    SetupInvalid,
    SourceNotAllowed,
    SshError,
    SystemNotFound,
    TooManySetups,
    VerificationError,
)
from qiip_core._errors._state import BackupInvalid, StateConflict, StateError

__all__ = [
    "AcquisitionPaused",
    "ArtifactAmbiguous",
    "ArtifactIdInvalid",
    "ArtifactNotFound",
    "AuthError",
    "BackupInvalid",
    "BmcTimeout",
    "BmcUnauthorized",
    "BmcUnreachable",
    "ConfigError",
    "DeploymentConflict",
    "DeploymentError",
    "DeploymentInvalid",
    "DeploymentNotFound",
    "DigestMismatch",
    "DownloadFailed",
    "EndpointError",
    "EndpointNotAllowed",
    "EndpointNotSupported",
    "EngineBuildError",
    "EngineError",
    "EngineLaunchError",
    "EngineNotInstalled",
    "FailoverExhausted",
    "HostBusy",
    "HostKeyMismatch",
    "HostNotAllowed",
    "HostNotFound",
    "HostNotInPool",
    "HostPoolError",
    "HostReserved",
    "LeaseLost",
    "LlmfitError",
    "LlmfitNotInstalled",
    "ManifestInvalid",
    "ModelFileError",
    "ModelNotFound",
    "ModelOverloaded",
    "ModelStoreError",
    "ModelUnavailable",
    "NoNodes",
    "NodeConflict",
    "NodeNotFound",
    "ObjectMismatch",
    "PlanError",
    "PowerNotConfigured",
    "ProvisioningError",
    "QiipError",
    "QuadsUnavailable",
    "RedfishError",
    "RegistryError",
    "RegistryUnavailable",
    "RelaunchError",
    "RemoteTimeout",
    "ResetNotSupported",
    "RevisionInUse",
    "RevisionNotFound",
    "RoutingError",
    "SetupInvalid",
    "SourceNotAllowed",
    "SshError",
    "StateConflict",
    "StateError",
    "SystemNotFound",
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
    "escape_controls",
    "safe_text",
]
