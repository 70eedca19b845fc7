"""Node actions and the operations they start, for every screen and the command palette.

`ConsoleActions` is the part of the app that acts on nodes: it asks before anything destructive, calls the
daemon in a worker, follows the operation it started by polling `client.operation(id)`, and reports the end
with `notify()`. `QiipConsole` builds on it; it is split out only to keep each module readable.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from textual import work
from textual.signal import Signal

from qiip_core.client import ClientError, DaemonUnreachable, OperationInfo
from qiip_tui._fleet import Fleet
from qiip_tui._host_actions import HostActions
from qiip_tui._messages import OperationUpdated
from qiip_tui._serving import last_healthy_warning
from qiip_tui._types import ProvisioningSource
from qiip_tui.screens import ConfirmModal, NodeScreen, SizingScreen

if TYPE_CHECKING:
    from qiip_tui._types import ConsoleClient

__all__ = ["NODE_ACTIONS", "ConsoleActions"]

logger = logging.getLogger("qiip.console")

NODE_ACTIONS = ("open", "drain", "undrain", "remove", "relaunch", "power")
"""What `ConsoleActions.node_action` does."""

POWER_NOT_AVAILABLE = "Power control is not available on this daemon: it does not provision hosts."
"""What the power action says."""

_OPERATION_POLL_FAILURES = 20
"""Failed polls in a row after which the console stops following an operation (the daemon is gone)."""


class ConsoleActions(HostActions):
    """The app's node actions. Subclasses set `client`, `fleet`, `operation_signal` and the intervals."""

    client: ConsoleClient
    fleet: Fleet
    operation_signal: Signal[OperationInfo]
    operations: dict[str, OperationInfo]
    selected_node: str | None
    operation_poll_s: float
    node_poll_s: float

    def node_action(self, action: str, node_id: str | None) -> None:
        """Act on a node: `open`, `drain`, `undrain`, `remove`, `relaunch` or `power`.

        Drain and remove ask first; relaunch opens the sizing editor, which asks before it applies. Each
        confirmation warns when the node is the last healthy one of its model (`last_healthy_warning`).

        Raises:
            ValueError: an unknown action.
        """
        if action not in NODE_ACTIONS:
            raise ValueError(f"Unknown node action {action!r}; the actions are {', '.join(NODE_ACTIONS)}.")
        if node_id is None:
            self.notify("No node is selected: pick one in the fleet table first.", severity="warning")
            return
        node = self.fleet.nodes.get(node_id)
        if node is None:
            self.notify(f"Node {node_id} is not in the fleet any more.", severity="warning")
            return
        # Draining, removing and relaunching all take the node out of service for a while.
        warning = last_healthy_warning(node, self.fleet.nodes.values())
        last = f"\n\n{warning}" if warning else ""
        if action == "open":
            self.open_node(node_id)
        elif action == "drain":

            def drain(answer: bool | None) -> None:
                if answer is not None:
                    self._drain(node_id)

            self.push_screen(
                ConfirmModal(
                    f"Drain {node_id}?",
                    f"{node_id} gets no new requests; the {node.in_flight} in flight finish, up to the daemon's "
                    f"drain timeout. Undrain (u) takes it back.{last}",
                    confirm="Drain",
                ),
                callback=drain,
            )
        elif action == "undrain":
            self._undrain(node_id)
        elif action == "remove":

            def remove(force: bool | None) -> None:
                if force is not None:
                    self._remove(node_id, force)

            self.push_screen(
                ConfirmModal(
                    f"Remove {node_id}?",
                    f"{node_id} is drained, then removed from the fleet; a llama-server this daemon launched is "
                    f"stopped. It does not come back by itself.{last}",
                    confirm="Remove",
                    option="Force: remove at once, without draining",
                ),
                callback=remove,
            )
        elif action == "relaunch":
            if node.llamacpp_runtime is None:
                self.notify(
                    f"Node {node_id} has no llama.cpp runtime record, so it has no sizing to edit; only managed "
                    "llama.cpp nodes can be relaunched.",
                    severity="warning",
                )
                return
            self.push_screen(SizingScreen(node), callback=self._relaunched)
        else:
            host = urlsplit(node.endpoint).hostname or node_id
            if not isinstance(self.client, ProvisioningSource):
                self.notify(POWER_NOT_AVAILABLE, title=f"Power {node_id}", severity="warning")
                return
            self._show_power(node_id, host)

    @work(group="host-actions", exit_on_error=False)
    async def _show_power(self, node_id: str, host: str) -> None:
        """Say the power state of `node_id`'s host, as its BMC reports it."""
        assert isinstance(self.client, ProvisioningSource)
        try:
            answer = await self.client.power_state(host)
        except ClientError as exc:
            message = getattr(exc, "message", None) or str(exc)
            self.notify(f"Power of {host} unknown: {message}", title=f"Power {node_id}", severity="warning")
            return
        self.notify(
            f"{host} is powered {answer.get('power_state', '?')}; the provisioning screen (l) powers it on, off or "
            "restarts it.",
            title=f"Power {node_id}",
        )

    def open_node(self, node_id: str) -> None:
        """Show the node screen of `node_id` (in the fleet mode)."""
        self.selected_node = node_id
        if self.current_mode != "fleet":
            self.switch_mode("fleet")
        if isinstance(self.screen, NodeScreen) and self.screen.node_id == node_id:
            return
        self.push_screen(NodeScreen(node_id, poll_interval_s=self.node_poll_s))

    # -- workers -----------------------------------------------------------------------------------------
    # Not exclusive: an operator may drain one node and remove another while the first call is in flight.

    @work(group="node-actions", exit_on_error=False)
    async def _drain(self, node_id: str) -> None:
        try:
            operation = await self.client.drain(node_id)
        except ClientError as exc:
            self.notify(exc.message, title=f"Drain {node_id}", severity="error")
            return
        self.track_operation(operation)

    @work(group="node-actions", exit_on_error=False)
    async def _undrain(self, node_id: str) -> None:
        try:
            await self.client.undrain(node_id)
        except ClientError as exc:
            self.notify(exc.message, title=f"Undrain {node_id}", severity="error")
            return
        self.notify(f"{node_id} is back in rotation.", title=f"Undrain {node_id}")

    @work(group="node-actions", exit_on_error=False)
    async def _remove(self, node_id: str, force: bool) -> None:
        try:
            operation = await self.client.remove(node_id, force=force)
        except ClientError as exc:
            self.notify(exc.message, title=f"Remove {node_id}", severity="error")
            return
        self.track_operation(operation)

    def _relaunched(self, operation: OperationInfo | None) -> None:
        if operation is not None:
            self.track_operation(operation)

    def track_operation(self, operation: OperationInfo) -> None:
        """Show an operation the console started, and follow it to its end."""
        self.post_message(OperationUpdated(operation))
        if operation.state == "running":
            self._follow_operation(operation)

    @work(group="operations", exit_on_error=False)
    async def _follow_operation(self, operation: OperationInfo) -> None:
        failures = 0
        while operation.state == "running" and failures < _OPERATION_POLL_FAILURES:
            await asyncio.sleep(self.operation_poll_s)
            try:
                current = await self.client.operation(operation.id)
            except DaemonUnreachable:
                failures += 1
                continue
            except ClientError as exc:
                self.notify(exc.message, title=f"{operation.kind} {operation.node_id}", severity="error")
                return
            failures = 0
            if current != operation:
                operation = current
                self.post_message(OperationUpdated(current))
        if failures:
            self.notify(
                f"Lost track of {operation.kind} {operation.id}: the daemon does not answer.",
                title=f"{operation.kind} {operation.node_id}",
                severity="warning",
            )

    def on_operation_updated(self, message: OperationUpdated) -> None:
        operation = message.operation
        before = self.operations.get(operation.id)
        self.operations[operation.id] = operation
        self.operation_signal.publish(operation)
        if operation.state == "running" or (before is not None and before.state == operation.state):
            return
        title = f"{operation.kind.capitalize()} {operation.node_id}"
        if operation.state == "succeeded":
            self.notify(f"{operation.kind} of {operation.node_id} succeeded.", title=title)
        else:
            self.notify(operation.error or f"{operation.kind} failed.", title=f"{title} failed", severity="error")
