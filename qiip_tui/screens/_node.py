"""The node screen: one node's devices and their history, its llama.cpp runtime record, its errors, and the
actions an operator takes on it.

While the screen is open it polls the node every `poll_interval_s` (the daemon's events do not report memory
or in-flight changes), and keeps the readings as the sparklines' history; closing the screen forgets them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Footer, Header, Label, Sparkline, Static

from qiip_core.client import ClientError, NodeInfo, OperationInfo
from qiip_core.planner import DeviceMemory
from qiip_tui._fleet import FleetDelta, devices_of
from qiip_tui._messages import NodePolled
from qiip_tui.screens._base import ConsoleScreen
from qiip_tui.widgets import GpuMeter, NodeHeader, OperationPanel, RuntimeView

__all__ = ["NodeScreen"]

HISTORY_SAMPLES = 60
"""Readings kept per sparkline (two minutes at the default poll interval)."""

RECENT_ERRORS = 5
"""Errors listed under the record."""


def _device_label(device: DeviceMemory) -> str:
    return "CPU" if device.kind == "cpu" else f"GPU {device.index}"


class NodeScreen(ConsoleScreen[None]):
    """One node.

    Args:
        node_id: the node to show.
        poll_interval_s: seconds between polls of the node while the screen is open.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("d", "node('drain')", "Drain"),
        Binding("u", "node('undrain')", "Undrain"),
        Binding("x", "node('remove')", "Remove"),
        Binding("r", "node('relaunch')", "Relaunch"),
        Binding("p", "node('power')", "Power"),
        Binding("escape,q", "back", "Back"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | d u x r p | Drain, undrain, remove, relaunch (sizing editor), power. |
    | escape, q | Back to the fleet. |
    """

    def __init__(self, node_id: str, *, poll_interval_s: float = 2.0) -> None:
        super().__init__()
        self.node_id = node_id
        self.poll_interval_s = poll_interval_s
        self._memory: dict[int, deque[float]] = {}
        self._in_flight: deque[float] = deque(maxlen=HISTORY_SAMPLES)
        self._errors: deque[str] = deque(maxlen=RECENT_ERRORS)
        self._gpu_indexes: tuple[int, ...] | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield NodeHeader(self.node_id, id="node-header")
        with VerticalScroll(id="node-body"):
            with Horizontal(id="node-panels"):
                with Vertical(id="devices"):
                    yield Label("Devices", classes="section")
                    yield Vertical(id="meters")
                    yield Label("In flight", classes="section", id="in-flight-label")
                    yield Sparkline([], id="in-flight")
                    yield Label("Recent errors", classes="section")
                    yield Static("none", id="errors", markup=False)
                with Vertical(id="runtime"):
                    yield Label("llama.cpp runtime", classes="section")
                    yield RuntimeView(id="runtime-view")
                    yield Static("", id="unverified", markup=False)
        yield OperationPanel(id="operation")
        with Horizontal(id="actions"):
            for action, label in (
                ("drain", "Drain"),
                ("undrain", "Undrain"),
                ("remove", "Remove"),
                ("relaunch", "Relaunch"),
                ("power", "Power"),
            ):
                yield Button(label, id=action, compact=True, variant="error" if action == "remove" else "default")
        yield Footer()

    def on_mount(self) -> None:
        self.console.fleet_signal.subscribe(self, self._fleet_changed)
        self.console.operation_signal.subscribe(self, self._operation_changed)
        node = self.console.fleet.nodes.get(self.node_id)
        if node is not None:
            self._sample(node)
        self._show(node)
        for operation in self.console.operations.values():
            if operation.node_id == self.node_id:
                self._operation_changed(operation)
        self._poll()

    # -- data --------------------------------------------------------------------------------------------

    @work(exclusive=True, group="node-poll", exit_on_error=False)
    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                node = await self.console.client.node(self.node_id)
            except ClientError:
                # The app's connection watch reports an unreachable daemon; a missing node shows as removed.
                continue
            self.post_message(NodePolled(node))

    def on_node_polled(self, message: NodePolled) -> None:
        # Not stopped: the app takes the reading into the fleet too.
        if message.node.id == self.node_id:
            self._sample(message.node)

    def _sample(self, node: NodeInfo) -> None:
        for device in devices_of(node):
            self._memory.setdefault(device.index, deque(maxlen=HISTORY_SAMPLES)).append(device.used_mib)
        self._in_flight.append(node.in_flight)
        if node.last_error and (not self._errors or self._errors[-1] != node.last_error):
            self._errors.append(node.last_error)

    def _fleet_changed(self, delta: FleetDelta) -> None:
        if self.node_id in delta.removed:
            self._show(None)
        elif self.node_id in delta.changed:
            node = self.console.fleet.nodes[self.node_id]
            if node.last_error and (not self._errors or self._errors[-1] != node.last_error):
                self._errors.append(node.last_error)
            self._show(node)

    def _operation_changed(self, operation: OperationInfo) -> None:
        if operation.node_id != self.node_id:
            return
        self.query_one("#operation", OperationPanel).show(operation)
        if operation.state == "failed" and operation.error:
            self._errors.append(f"{operation.kind} failed: {operation.error}")
            self._show_errors()

    # -- view --------------------------------------------------------------------------------------------

    def _show(self, node: NodeInfo | None) -> None:
        self.query_one("#node-header", NodeHeader).show(node)
        if node is None:
            return
        self._show_devices(node)
        history = list(self._in_flight)
        self.query_one("#in-flight", Sparkline).data = history if len(history) > 1 else []
        peak = max(history, default=0)
        self.query_one("#in-flight-label", Label).update(f"In flight: {node.in_flight} now, peak {peak:g}")
        self.query_one("#runtime-view", RuntimeView).show(node.llamacpp_runtime)
        unverified = node.llamacpp_runtime.unverified if node.llamacpp_runtime is not None else []
        notes = self.query_one("#unverified", Static)
        notes.update("\n".join(f"Not verified — {item}" for item in unverified))
        notes.display = bool(unverified)
        self._show_errors()

    def _show_devices(self, node: NodeInfo) -> None:
        meters = self.query_one("#meters", Vertical)
        devices = devices_of(node)
        indexes = tuple(device.index for device in devices)
        if indexes != self._gpu_indexes:
            self._gpu_indexes = indexes
            meters.remove_children()
            if not devices:
                meters.mount(Static("— no device memory reported", classes="muted"))
        for device in devices:
            history = self._memory.get(device.index, deque())
            found = meters.query(f"#gpu-{device.index}")
            meter = found.first(GpuMeter) if found else GpuMeter(_device_label(device), id=f"gpu-{device.index}")
            meter.show(device.used_mib, device.total_mib, history)
            if not found:
                meters.mount(meter)

    def _show_errors(self) -> None:
        errors = self.query_one("#errors", Static)
        errors.update("\n".join(reversed(self._errors)) if self._errors else "none")

    # -- actions -----------------------------------------------------------------------------------------

    def action_node(self, action: str) -> None:
        """Run a node action (`drain`, `undrain`, `remove`, `relaunch`, `power`) on this node."""
        self.console.node_action(action, self.node_id)

    @on(Button.Pressed, "#actions Button")
    def _button(self, event: Button.Pressed) -> None:
        if event.button.id is not None:
            self.action_node(event.button.id)

    def action_back(self) -> None:
        """Back to the fleet."""
        self.dismiss()
