"""Nodes: the registration record, its statuses, the endpoint allowlist, and what an Ollama node's native API says."""

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
from qiip_core.nodes._ollama import (
    MAX_RESIDENT,
    OLLAMA_LOAD_FAILURES,
    OLLAMA_MIN_VERSION,
    ResidentModel,
    check_ollama_version,
    is_load_failure,
    listed_models,
    ollama_model_key,
    resident_models,
)
from qiip_core.nodes._reach import METADATA_ADDRESSES, address_refusal, check_settings_url

__all__ = [
    "DEFAULT_ALLOWED_HOSTS",
    "DEFAULT_ALLOWED_NETWORKS",
    "LIFECYCLE_STATUSES",
    "LIVENESS_STATUSES",
    "MAX_RESIDENT",
    "METADATA_ADDRESSES",
    "OLLAMA_LOAD_FAILURES",
    "OLLAMA_MIN_VERSION",
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
    "ResidentModel",
    "address_refusal",
    "check_model_name",
    "check_ollama_version",
    "check_settings_url",
    "is_load_failure",
    "listed_models",
    "ollama_model_key",
    "parse_endpoint",
    "resident_models",
]
