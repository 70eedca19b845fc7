"""The console's screens, one per module."""

from __future__ import annotations

from qiip_tui.screens._chat import ChatScreen
from qiip_tui.screens._command import CommandLine, run_command
from qiip_tui.screens._confirm import ConfirmModal
from qiip_tui.screens._connection import ConnectionScreen
from qiip_tui.screens._deployments import DEPLOYMENTS_NOT_AVAILABLE, DeploymentsScreen
from qiip_tui.screens._describe import DescribeScreen
from qiip_tui.screens._download import DownloadModal
from qiip_tui.screens._fleet import FleetScreen
from qiip_tui.screens._help import HelpScreen, key_map, screen_name
from qiip_tui.screens._logs import NOT_AVAILABLE, LogsScreen
from qiip_tui.screens._models import MODELS_NOT_AVAILABLE, ModelsScreen
from qiip_tui.screens._node import NodeScreen
from qiip_tui.screens._recommendations import RECOMMENDATIONS_NOT_AVAILABLE, RecommendationsScreen
from qiip_tui.screens._scale import ScaleModal
from qiip_tui.screens._sizing import SizingScreen

__all__ = [
    "DEPLOYMENTS_NOT_AVAILABLE",
    "MODELS_NOT_AVAILABLE",
    "NOT_AVAILABLE",
    "RECOMMENDATIONS_NOT_AVAILABLE",
    "ChatScreen",
    "CommandLine",
    "ConfirmModal",
    "ConnectionScreen",
    "DeploymentsScreen",
    "DescribeScreen",
    "DownloadModal",
    "FleetScreen",
    "HelpScreen",
    "LogsScreen",
    "ModelsScreen",
    "NodeScreen",
    "RecommendationsScreen",
    "ScaleModal",
    "SizingScreen",
    "key_map",
    "run_command",
    "screen_name",
]
