"""Settings: one pydantic-settings model, loaded from the environment, `.env` and a TOML file."""

from __future__ import annotations

from qiip_core.config._listen import bind_listener
from qiip_core.config._models import ModelSettings
from qiip_core.config._settings import (
    AdminSettings,
    AttachedProfile,
    AuthSettings,
    BreakerSettings,
    EtcdSettings,
    HealthSettings,
    LlamaCppEngineSettings,
    LocalNodeConfig,
    LoggingSettings,
    NodeConfig,
    ProvisioningSettings,
    QuadsSettings,
    RedfishSettings,
    RegistrySettings,
    RoutingSettings,
    ServerSettings,
    Settings,
    TelemetryAgentConfig,
    TelemetrySettings,
    UpstreamSettings,
    default_state_dir,
    format_validation_error,
    load_settings,
)
from qiip_core.config._statelock import LOCAL_NODES_LOCK, StateDirLock, local_nodes_in_use

__all__ = [
    "LOCAL_NODES_LOCK",
    "AdminSettings",
    "AttachedProfile",
    "AuthSettings",
    "BreakerSettings",
    "EtcdSettings",
    "HealthSettings",
    "LlamaCppEngineSettings",
    "LocalNodeConfig",
    "LoggingSettings",
    "ModelSettings",
    "NodeConfig",
    "ProvisioningSettings",
    "QuadsSettings",
    "RedfishSettings",
    "RegistrySettings",
    "RoutingSettings",
    "ServerSettings",
    "Settings",
    "StateDirLock",
    "TelemetryAgentConfig",
    "TelemetrySettings",
    "UpstreamSettings",
    "bind_listener",
    "default_state_dir",
    "format_validation_error",
    "load_settings",
    "local_nodes_in_use",
]
