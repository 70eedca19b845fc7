"""A Python client of a running daemon (admin and client APIs), and where the console finds it."""

from __future__ import annotations

from qiip_core.client._client import QiipClient
from qiip_core.client._config import (
    DEFAULT_URL,
    ConsoleConfig,
    check_daemon_url,
    console_config_paths,
    load_console_config,
    read_console_file,
)
from qiip_core.client._errors import ApiError, ClientError, DaemonUnreachable, NotADaemon, Unauthorized
from qiip_core.client._views import (
    BreakerView,
    ChatDelta,
    HealthView,
    LentHosts,
    NodeErrorView,
    NodeEvent,
    NodeInfo,
    OperationInfo,
    QuadsFreshness,
    QuadsView,
    ResidentModelView,
    SlotsView,
)

__all__ = [
    "DEFAULT_URL",
    "ApiError",
    "BreakerView",
    "ChatDelta",
    "ClientError",
    "ConsoleConfig",
    "DaemonUnreachable",
    "HealthView",
    "LentHosts",
    "NodeErrorView",
    "NodeEvent",
    "NodeInfo",
    "NotADaemon",
    "OperationInfo",
    "QiipClient",
    "QuadsFreshness",
    "QuadsView",
    "ResidentModelView",
    "SlotsView",
    "Unauthorized",
    "check_daemon_url",
    "console_config_paths",
    "load_console_config",
    "read_console_file",
]
