"""The node screen: one node's traffic and its history, its devices, its llama.cpp runtime record, its errors
with their times, and the actions an operator takes on it.

While the screen is open it polls the node every `poll_interval_s` (the daemon's events do not report memory
or in-flight changes), and keeps the readings as the device sparklines' history; closing the screen forgets
them. The traffic history is the fleet's (`Fleet.rates`), kept for every node from the console's start.
"""

from __future__ import annotations

import asyncio
from collections import deque
from datetime import datetime
from typing import ClassVar

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Header, Label, Sparkline, Static

from qiip_core.client import ClientError, NodeInfo, OperationInfo
from qiip_core.planner import DeviceMemory
from qiip_tui._describe import error_line, node_errors, resident_lines
from qiip_tui._fleet import FleetDelta, live_readings, shown_devices, slots_of
from qiip_tui._messages import NodePolled
from qiip_tui._recommendations import host_of
from qiip_tui._render import Palette, age_text
from qiip_tui.screens._base import ConsoleScreen
from qiip_tui.screens._recommendations import RecommendationsScreen
from qiip_tui.widgets import (
    GpuMeter,
    HistorySparkline,
    KeyFooter,
    NodeHeader,
    OperationPanel,
    RuntimeView,
    TrafficPanel,
)

__all__ = ["NodeScreen"]

HISTORY_SAMPLES = 60
"""Readings kept per sparkline (two minutes at the default poll interval)."""

RECENT_ERRORS = 5
"""Errors listed under the record (the describe view, `d`, lists all the daemon keeps)."""


def _device_label(device: DeviceMemory) -> str:
    return "CPU" if device.kind == "cpu" else f"GPU {device.index}"


def _live_detail(node: NodeInfo, index: int) -> tuple[int | None, str]:
    """The device's utilisation in percent and its temperature and power (`71°C · 612W`), from `qiip agent`'s live
    reading; else the utilisation of the runtime record."""
    for gpu in live_readings(node):
        if gpu.index == index:
            extra = [f"{gpu.temperature_c}°C"] if gpu.temperature_c is not None else []
            extra += [f"{gpu.power_w:.0f}W"] if gpu.power_w is not None else []
            return gpu.utilization_percent, " · ".join(extra)
    return _utilization(node, index), ""


def _utilization(node: NodeInfo, index: int) -> int | None:
    """The device's compute utilisation in percent, where the runtime record reports it (`gpus[].utilization_pct`)."""
    runtime = node.llamacpp_runtime
    for gpu in runtime.gpus if runtime is not None else ():
        value = gpu.get("utilization_pct")
        if gpu.get("index") == index and isinstance(value, int | float):
            return round(value)
    return None


class NodeScreen(ConsoleScreen[None]):
    """One node.

    Args:
        node_id: the node to show.
        poll_interval_s: seconds between polls of the node while the screen is open.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("d", "node('describe')", "Describe"),
        Binding("D", "node('drain')", "Drain"),
        Binding("u", "node('undrain')", "Undrain"),
        Binding("x", "node('remove')", "Remove"),
        Binding("r", "node('relaunch')", "Relaunch"),
        Binding("p", "node('power')", "Power"),
        Binding("w", "what_fits", "What fits"),
        Binding("escape,q", "back", "Back"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | d | Describe the node: its state, all its errors, its events and record, as text (`y` copies it). |
    | D u x r p | Drain, undrain, remove, relaunch (sizing editor), power. |
    | w | What fits the node's host: llmfit's recommendations, marked when the catalog holds them. |
    | escape, q | Back to the fleet. |
    """

    def __init__(self, node_id: str, *, poll_interval_s: float = 2.0) -> None:
        super().__init__()
        self.node_id = node_id
        self.poll_interval_s = poll_interval_s
        self._memory: dict[int, deque[float]] = {}
        self._in_flight: deque[float] = deque(maxlen=HISTORY_SAMPLES)
        self._operation_errors: deque[tuple[datetime, str]] = deque(maxlen=RECENT_ERRORS)
        self._gpu_indexes: tuple[int, ...] | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield NodeHeader(self.node_id, id="node-header")
        with VerticalScroll(id="node-body"):
            yield Label("Traffic", classes="section")
            yield TrafficPanel(id="traffic")
            with Horizontal(id="node-panels"):
                with Vertical(id="devices"):
                    yield Label("Devices", classes="section", id="devices-label")
                    yield Vertical(id="meters")
                    yield Label("In flight", classes="section", id="in-flight-label")
                    yield HistorySparkline(capacity=HISTORY_SAMPLES, id="in-flight")
                    yield Label("Recent errors", classes="section")
                    yield Static("none", id="errors", markup=False)
                with Vertical(id="runtime"):
                    yield Label("llama.cpp runtime", classes="section", id="runtime-label")
                    yield RuntimeView(id="runtime-view")
                    yield Static("", id="unverified", markup=False)
                    yield Label("Loaded model", classes="section", id="resident-label")
                    yield Static("", id="resident", markup=False)
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
        yield KeyFooter()

    def on_mount(self) -> None:
        self.console.fleet_signal.subscribe(self, self._fleet_changed)
        self.console.operations.signal.subscribe(self, self._operation_changed)
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
        for device in shown_devices(node):
            self._memory.setdefault(device.index, deque(maxlen=HISTORY_SAMPLES)).append(device.used_mib)
        self._in_flight.append(node.in_flight)

    def _fleet_changed(self, delta: FleetDelta) -> None:
        if self.node_id in delta.removed:
            self._show(None)
        elif self.node_id in delta.changed:
            self._show(self.console.fleet.nodes[self.node_id])
        elif not delta:
            # A metrics poll: new rates, and the errors' ages moved on.
            polled = self.console.fleet.nodes.get(self.node_id)
            if polled is not None:
                if polled.quads is not None:  # the countdown moved on
                    self.query_one("#node-header", NodeHeader).show(polled, now=self.console.wall_clock())
                self._show_traffic(polled)
                self._show_errors(polled)

    def _operation_changed(self, operation: OperationInfo) -> None:
        if operation.node_id != self.node_id:
            return
        self.query_one("#operation", OperationPanel).show(operation)
        if operation.state == "failed" and operation.error:
            self._operation_errors.append((self.console.wall_clock(), f"{operation.kind} failed: {operation.error}"))
            self._show_errors(self.console.fleet.nodes.get(self.node_id))

    # -- view --------------------------------------------------------------------------------------------

    def _show(self, node: NodeInfo | None) -> None:
        self.query_one("#node-header", NodeHeader).show(node, now=self.console.wall_clock())
        if node is None:
            return
        self._show_devices(node)
        self._show_traffic(node)
        history = list(self._in_flight)
        self.query_one("#in-flight", Sparkline).data = history if len(history) > 1 else []
        # The reading shown now counts too, whether or not a poll sampled it yet.
        peak = max([*history, node.in_flight])
        self.query_one("#in-flight-label", Label).update(f"In flight: {node.in_flight} now, peak {peak:g}")
        self.query_one("#runtime-view", RuntimeView).show(node.llamacpp_runtime)
        unverified = node.llamacpp_runtime.unverified if node.llamacpp_runtime is not None else []
        notes = self.query_one("#unverified", Static)
        notes.update("\n".join(f"Not verified — {item}" for item in unverified))
        notes.display = bool(unverified)
        # An Ollama node says what it holds in memory (GET /api/ps) and has no llama.cpp runtime record.
        ollama = node.engine == "ollama"
        resident = self.query_one("#resident", Static)
        resident.update("\n".join(resident_lines(node)) or "not loaded")
        resident.display = self.query_one("#resident-label", Label).display = ollama
        self.query_one("#runtime-view", RuntimeView).display = not ollama
        self.query_one("#runtime-label", Label).display = not ollama
        self._show_errors(node)

    def _show_traffic(self, node: NodeInfo) -> None:
        rates = self.console.fleet.rates
        self.query_one("#traffic", TrafficPanel).show(
            rates.nodes.get(node.id),
            rates.history.get(node.id, ()),
            slots=slots_of(node),
            palette=Palette.from_variables(self.app.theme_variables),
        )

    def _show_devices(self, node: NodeInfo) -> None:
        meters = self.query_one("#meters", Vertical)
        devices = shown_devices(node)
        live = node.gpus_live if live_readings(node) else None
        self.query_one("#devices-label", Label).update(
            "Devices" if live is None else f"Devices · live {age_text(live.read_at, self.console.wall_clock())}"
        )
        indexes = tuple(device.index for device in devices)
        if indexes != self._gpu_indexes:
            self._gpu_indexes = indexes
            meters.remove_children()
            if not devices:
                meters.mount(Static("— no device memory reported", classes="muted"))
        for device in devices:
            history = self._memory.get(device.index, deque())
            found = meters.query(f"#gpu-{device.index}")
            meter = (
                found.first(GpuMeter)
                if found
                else GpuMeter(_device_label(device), capacity=HISTORY_SAMPLES, id=f"gpu-{device.index}")
            )
            utilization, detail = _live_detail(node, device.index)
            meter.show(device.used_mib, device.total_mib, history, utilization_pct=utilization, detail=detail)
            if not found:
                meters.mount(meter)

    def _show_errors(self, node: NodeInfo | None) -> None:
        """The recent errors (the daemon's record of the node, and operations started here that failed), newest
        first, each with its time, age and count; dimmed once the node is healthy again."""
        errors = self.query_one("#errors", Static)
        shown = node_errors(node, self._operation_errors)[:RECENT_ERRORS]
        if not shown:
            errors.update("none")
            return
        now = self.console.wall_clock()
        recovered = node is not None and node.status == "healthy" and node.breaker.state == "closed"
        text = Text()
        for error in shown:
            if text:
                text.append("\n")
            when, message = error_line(error, now)
            text.append(when + " ", style="bold")
            text.append(message)
        if recovered:
            text.stylize("dim")
            text.append("\nThe node is healthy again: these errors are past.", style="italic")
        errors.update(text)

    # -- actions -----------------------------------------------------------------------------------------

    def action_node(self, action: str) -> None:
        """Run a node action (`describe`, `drain`, `undrain`, `remove`, `relaunch`, `power`) on this node."""
        self.console.node_action(action, self.node_id)

    @on(Button.Pressed, "#actions Button")
    def _button(self, event: Button.Pressed) -> None:
        if event.button.id is not None:
            self.action_node(event.button.id)

    def action_what_fits(self) -> None:
        """Open llmfit's recommendations for the host this node runs on."""
        node = self.console.fleet.nodes.get(self.node_id)
        host = host_of(node) if node is not None else None
        if host is None:
            self.notify(f"Node {self.node_id} has no host to ask: its endpoint names none.", severity="warning")
            return
        self.app.push_screen(RecommendationsScreen(host))

    def action_back(self) -> None:
        """Back to the fleet."""
        self.dismiss()
