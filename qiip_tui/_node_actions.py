"""Node actions, for every screen and the command palette: drain, undrain, remove, relaunch, power, open, describe.

`NodeActions` is the part of the console that acts on nodes: it asks before anything destructive, calls the
daemon in a worker, hands a started operation to the `OperationTracker`, and reports a refusal with `notify()`.
The app holds one; screens reach it as `ConsoleContext.node_action`.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from qiip_core.client import ClientError, OperationInfo
from qiip_tui._serving import last_healthy_warning, unserved_models_warning
from qiip_tui._types import ProvisioningSource
from qiip_tui.screens import ConfirmModal, DescribeScreen, NodeScreen, SizingScreen

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Sequence

    from textual.app import App
    from textual.worker import Worker

    from qiip_tui._context import Selection
    from qiip_tui._fleet import Fleet
    from qiip_tui._operations import OperationTracker
    from qiip_tui._types import ConsoleClient

__all__ = ["NODE_ACTIONS", "POWER_NOT_AVAILABLE", "NodeActions"]

logger = logging.getLogger("qiip.console")

NODE_ACTIONS = ("open", "describe", "drain", "undrain", "remove", "relaunch", "power")
"""What `NodeActions.node_action` does."""

MANY_ACTIONS = ("drain", "undrain", "remove")
"""What `NodeActions.nodes_action` does to several nodes at once."""

POWER_NOT_AVAILABLE = "Power control is not available on this daemon: it does not provision hosts."
"""What the power action says."""

CONFIG_SOURCE = "config"
"""The source of a node declared in the daemon's config file (`[[nodes]]`): the daemon refuses to remove it."""

LOCAL_SOURCE = "local"
"""The source of a node the daemon launches from its config (`[[local_nodes]]`): removed, it comes back at the
daemon's next start."""


def config_node_note(node_id: str) -> str:
    """Why a node declared in the config file is not removed from here (the daemon's own refusal, with the way)."""
    return (
        f"{node_id} is declared in the daemon's config file ([[nodes]]), so the daemon does not remove it: delete "
        "it there and restart the daemon, or drain it (D) to take it out of service."
    )


def _comes_back(source: str) -> str:
    if source == LOCAL_SOURCE:
        return "It comes back when the daemon next starts: it is declared in [[local_nodes]] of its config."
    return "It does not come back by itself."


FLEET_MODE = "fleet"
"""The app mode whose screen stack holds the node screens."""


class NodeActions:
    """The console's node actions.

    Args:
        app: the app that shows the dialogs and notifications and runs the workers.
        client: the daemon's client.
        fleet: the fleet the actions look nodes up in.
        operations: where a started operation is followed.
        selection: the selection `open` moves to the opened node.
        node_poll_s: seconds between polls of the node an opened node screen shows.
    """

    def __init__(
        self,
        app: App[Any],
        client: ConsoleClient,
        fleet: Fleet,
        operations: OperationTracker,
        selection: Selection,
        *,
        node_poll_s: float,
    ) -> None:
        self._app = app
        self._client = client
        self._fleet = fleet
        self._operations = operations
        self._selection = selection
        self.node_poll_s = node_poll_s

    def node_action(self, action: str, node_id: str | None) -> None:
        """Act on a node: `open`, `describe`, `drain`, `undrain`, `remove`, `relaunch` or `power`.

        Drain and remove ask first; relaunch opens the sizing editor, which asks before it applies. Each
        confirmation warns when the node is the last healthy one of its model (`last_healthy_warning`).

        Raises:
            ValueError: an unknown action.
        """
        if action not in NODE_ACTIONS:
            raise ValueError(f"Unknown node action {action!r}; the actions are {', '.join(NODE_ACTIONS)}.")
        app = self._app
        if node_id is None:
            app.notify("No node is selected: pick one in the fleet table first.", severity="warning")
            return
        node = self._fleet.nodes.get(node_id)
        if node is None:
            app.notify(f"Node {node_id} is not in the fleet any more.", severity="warning")
            return
        # Draining, removing and relaunching all take the node out of service for a while.
        warning = last_healthy_warning(node, self._fleet.nodes.values())
        last = f"\n\n{warning}" if warning else ""
        if action == "open":
            self.open_node(node_id)
        elif action == "describe":
            app.push_screen(DescribeScreen(node_id))
        elif action == "drain":

            def drain(answer: bool | None) -> None:
                if answer is not None:
                    self._run(self._drain, node_id)

            app.push_screen(
                ConfirmModal(
                    f"Drain {node_id}?",
                    f"{node_id} gets no new requests; the {node.in_flight} in flight finish, up to the daemon's "
                    f"drain timeout. Undrain (u) takes it back.{last}",
                    confirm="Drain",
                ),
                callback=drain,
            )
        elif action == "undrain":
            self._run(self._undrain, node_id)
        elif action == "remove":
            if node.source == CONFIG_SOURCE:
                app.notify(config_node_note(node_id), title=f"Remove {node_id}", severity="warning", timeout=12)
                return

            def remove(force: bool | None) -> None:
                if force is not None:
                    self._run(self._remove, node_id, force)

            app.push_screen(
                ConfirmModal(
                    f"Remove {node_id}?",
                    f"{node_id} is drained, then removed from the fleet; a llama-server this daemon launched is "
                    f"stopped. {_comes_back(node.source)}{last}",
                    confirm="Remove",
                    option="Force: remove at once, without draining",
                ),
                callback=remove,
            )
        elif action == "relaunch":
            if node.llamacpp_runtime is None:
                app.notify(
                    f"Node {node_id} has no llama.cpp runtime record, so it has no sizing to edit; only managed "
                    "llama.cpp nodes can be relaunched.",
                    severity="warning",
                )
                return
            app.push_screen(SizingScreen(node), callback=self._relaunched)
        else:
            host = urlsplit(node.endpoint).hostname or node_id
            if not isinstance(self._client, ProvisioningSource):
                app.notify(POWER_NOT_AVAILABLE, title=f"Power {node_id}", severity="warning")
                return
            self._run(self._show_power, node_id, host, group="host-actions")

    def nodes_action(self, action: str, node_ids: Sequence[str], *, then: Callable[[], object] | None = None) -> None:
        """Drain, undrain or remove several nodes, after one confirmation that lists them.

        Args:
            action: `drain`, `undrain` or `remove`.
            node_ids: the nodes; those no longer in the fleet are left out (and the rest named).
            then: called once the operator confirmed (the marks can go), not when they cancelled.

        Raises:
            ValueError: an action other than those three.
        """
        if action not in MANY_ACTIONS:
            raise ValueError(f"{action!r} does not act on several nodes; those that do are {', '.join(MANY_ACTIONS)}.")
        app = self._app
        nodes = [self._fleet.nodes[node_id] for node_id in node_ids if node_id in self._fleet.nodes]
        kept: list[str] = []
        if action == "remove":
            kept = [node.id for node in nodes if node.source == CONFIG_SOURCE]
            nodes = [node for node in nodes if node.source != CONFIG_SOURCE]
        if not nodes:
            if kept:
                note = (
                    config_node_note(kept[0])
                    if len(kept) == 1
                    else (
                        f"{', '.join(kept)} are declared in the daemon's config file ([[nodes]]), so the daemon "
                        "does not remove them: delete them there and restart the daemon, or drain them (D)."
                    )
                )
                app.notify(note, title=f"Remove {len(kept)} node{'s' if len(kept) != 1 else ''}", severity="warning")
            else:
                app.notify("None of the marked nodes is in the fleet any more.", severity="warning")
            return
        if len(nodes) == 1 and then is None and not kept:
            self.node_action(action, nodes[0].id)
            return
        ids = [node.id for node in nodes]
        listed = "\n".join(f"  {node.id}  {node.status}  {node.model}" for node in nodes)
        warning = unserved_models_warning(nodes, self._fleet.nodes.values()) if action != "undrain" else None
        last = f"\n\n{warning}" if warning else ""
        if kept:
            last += (
                f"\n\nNot removed: {', '.join(kept)} (declared in the daemon's config file; delete "
                f"{'it' if len(kept) == 1 else 'them'} there)."
            )
        if kept:
            last += (
                f"\n\nNot removed: {', '.join(kept)} (declared in the daemon's config file; delete "
                f"{'it' if len(kept) == 1 else 'them'} there)."
            )
        count = f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}"
        in_flight = sum(node.in_flight for node in nodes)
        bodies = {
            "drain": f"These get no new requests; the {in_flight} in flight finish, up to the daemon's drain timeout. "
            "Undrain (u) takes them back.",
            "undrain": "These are back in rotation.",
            "remove": "These are drained, then removed from the fleet; a llama-server this daemon launched is stopped. "
            + (
                "Those declared in [[local_nodes]] come back when the daemon next starts."
                if any(node.source == LOCAL_SOURCE for node in nodes)
                else "They do not come back by themselves."
            ),
        }

        def answered(answer: bool | None) -> None:
            if answer is None:
                return
            for node_id in ids:
                if action == "drain":
                    self._run(self._drain, node_id)
                elif action == "undrain":
                    self._run(self._undrain, node_id)
                else:
                    self._run(self._remove, node_id, answer)
            if then is not None:
                then()

        app.push_screen(
            ConfirmModal(
                f"{action.capitalize()} {count}?",
                f"{listed}\n\n{bodies[action]}{last}",
                confirm=action.capitalize(),
                option="Force: remove at once, without draining" if action == "remove" else None,
            ),
            callback=answered,
        )

    def open_node(self, node_id: str) -> None:
        """Show the node screen of `node_id` (in the fleet mode)."""
        app = self._app
        self._selection.node = node_id
        if app.current_mode != FLEET_MODE:
            app.switch_mode(FLEET_MODE)
        if isinstance(app.screen, NodeScreen) and app.screen.node_id == node_id:
            return
        app.push_screen(NodeScreen(node_id, poll_interval_s=self.node_poll_s))

    # -- workers -----------------------------------------------------------------------------------------
    # Not exclusive: an operator may drain one node and remove another while the first call is in flight.

    def _run(
        self, work: Callable[..., Coroutine[Any, Any, None]], *args: object, group: str = "node-actions"
    ) -> Worker[None]:
        return self._app.run_worker(partial(work, *args), group=group, exit_on_error=False)

    async def _show_power(self, node_id: str, host: str) -> None:
        """Say the power state of `node_id`'s host, as its BMC reports it."""
        client = self._client
        assert isinstance(client, ProvisioningSource)
        try:
            answer = await client.power_state(host)
        except ClientError as exc:
            message = getattr(exc, "message", None) or str(exc)
            self._app.notify(f"Power of {host} unknown: {message}", title=f"Power {node_id}", severity="warning")
            return
        self._app.notify(
            f"{host} is powered {answer.get('power_state', '?')}; the provisioning screen (l) powers it on, off or "
            "restarts it.",
            title=f"Power {node_id}",
        )

    async def _drain(self, node_id: str) -> None:
        try:
            operation = await self._client.drain(node_id)
        except ClientError as exc:
            self._app.notify(exc.message, title=f"Drain {node_id}", severity="error")
            return
        self._operations.track(operation)

    async def _undrain(self, node_id: str) -> None:
        try:
            await self._client.undrain(node_id)
        except ClientError as exc:
            self._app.notify(exc.message, title=f"Undrain {node_id}", severity="error")
            return
        self._app.notify(f"{node_id} is back in rotation.", title=f"Undrain {node_id}")

    async def _remove(self, node_id: str, force: bool) -> None:
        try:
            operation = await self._client.remove(node_id, force=force)
        except ClientError as exc:
            self._app.notify(exc.message, title=f"Remove {node_id}", severity="error")
            return
        self._operations.track(operation)

    def _relaunched(self, operation: OperationInfo | None) -> None:
        if operation is not None:
            self._operations.track(operation)
