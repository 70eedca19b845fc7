"""The console's widgets, one per module."""

from __future__ import annotations

from qiip_tui.widgets._console_input import ConsoleInput
from qiip_tui.widgets._console_table import ConsoleTable
from qiip_tui.widgets._fleet_summary import FleetSummary, SummaryView
from qiip_tui.widgets._fleet_table import FleetTable
from qiip_tui.widgets._gpu_meter import GpuMeter
from qiip_tui.widgets._history_sparkline import HistorySparkline
from qiip_tui.widgets._key_footer import KeyFooter
from qiip_tui.widgets._log_view import LogView
from qiip_tui.widgets._node_header import NodeHeader
from qiip_tui.widgets._operation_panel import OperationPanel
from qiip_tui.widgets._runtime_view import RuntimeView
from qiip_tui.widgets._target_sparkline import TargetSparkline
from qiip_tui.widgets._traffic_panel import TrafficPanel
from qiip_tui.widgets._transcript import Transcript
from qiip_tui.widgets._versioned_table import VersionedTable

__all__ = [
    "ConsoleInput",
    "ConsoleTable",
    "FleetSummary",
    "FleetTable",
    "GpuMeter",
    "HistorySparkline",
    "KeyFooter",
    "LogView",
    "NodeHeader",
    "OperationPanel",
    "RuntimeView",
    "SummaryView",
    "TargetSparkline",
    "TrafficPanel",
    "Transcript",
    "VersionedTable",
]
