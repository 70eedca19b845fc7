"""QIIP's core: the domain of a fleet of inference nodes, without any front end.

Subpackages, one per concern: `config` (settings), `nodes` (the node record and endpoint allowlist),
`discovery` (registries), `routing` (selection, circuit breakers, forwarding with failover), `health`
(background probes), `engines` (llama.cpp: install, test models, launch), `planner` (llama.cpp sizing:
estimates, policies, plans and their verification), `auth` (the invoke tokens clients present), `storage`
(atomic files, locked JSON documents, the etcd client and prefix follower that discovery, auth and the console
build on). The daemon (`qiip_proxy`), the console (`qiip_tui`) and the CLI (`qiip_cli`) present what the core
decides; the core imports none of them, nor Textual or Rich.

Imports point one way: no module or subpackage imports one that imports it back (engines → planner, discovery and
auth → storage, everything → the error tree). The import-linter contracts in pyproject.toml check it.
"""

from __future__ import annotations

from qiip_core._errors import (
    AuthError,
    ConfigError,
    DigestMismatch,
    EndpointError,
    EndpointNotAllowed,
    EndpointNotSupported,
    EngineBuildError,
    EngineError,
    EngineLaunchError,
    EngineNotInstalled,
    FailoverExhausted,
    HostBusy,
    HostKeyMismatch,
    HostNotAllowed,
    ModelFileError,
    ModelNotFound,
    ModelUnavailable,
    NodeConflict,
    NodeNotFound,
    NoNodes,
    PlanError,
    ProvisioningError,
    QiipError,
    RedfishError,
    RegistryError,
    RegistryUnavailable,
    RelaunchError,
    RemoteTimeout,
    RoutingError,
    SshError,
    TokenExpired,
    TokenInvalid,
    TokenNotFound,
    TokenRequestInvalid,
    TokenRevoked,
    TokenScopeError,
    TokenStoreUnavailable,
    TooManySetups,
    UpstreamConnectError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamTransportError,
    VerificationError,
)

__version__ = "0.1.0"

__all__ = [
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
    "FailoverExhausted",
    "HostBusy",
    "HostKeyMismatch",
    "HostNotAllowed",
    "ModelFileError",
    "ModelNotFound",
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
    "__version__",
]
