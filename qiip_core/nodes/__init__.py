"""Nodes: the registration record, its statuses, and the endpoint allowlist."""

from __future__ import annotations

from qiip_core.nodes._endpoint import (
    DEFAULT_ALLOWED_HOSTS,
    DEFAULT_ALLOWED_NETWORKS,
    Endpoint,
    EndpointPolicy,
    parse_endpoint,
)
from qiip_core.nodes._node import (
    LIFECYCLE_STATUSES,
    LIVENESS_STATUSES,
    PROVISIONED_ENGINE_CHOICES,
    PROVISIONED_ENGINES,
    ApiName,
    DeploymentRef,
    Engine,
    LlamaCppRuntime,
    ModelName,
    Node,
    NodeCapabilities,
    NodeStatus,
    ProvisionedEngine,
    check_model_name,
)

__all__ = [
    "DEFAULT_ALLOWED_HOSTS",
    "DEFAULT_ALLOWED_NETWORKS",
    "LIFECYCLE_STATUSES",
    "LIVENESS_STATUSES",
    "PROVISIONED_ENGINES",
    "PROVISIONED_ENGINE_CHOICES",
    "ApiName",
    "DeploymentRef",
    "Endpoint",
    "EndpointPolicy",
    "Engine",
    "LlamaCppRuntime",
    "ModelName",
    "Node",
    "NodeCapabilities",
    "NodeStatus",
    "ProvisionedEngine",
    "check_model_name",
    "parse_endpoint",
]
