"""Host actions: set a host up, cancel its running operation, tear its node down, power it — each asked first.

`HostActions` is the part of the console that provisions: the provisioning screen's keys and the command palette
call `host_action`, which asks (`ConfirmModal`, after the `SetupModal` form for a setup), calls the daemon in a
worker, and reports a refusal as one line naming the host and the daemon's reason. A started operation is
followed like the node actions' (`OperationTracker.track`). The app holds one.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from qiip_core.client import ClientError
from qiip_core.nodes import Engine
from qiip_tui._provisioning import POWER_ACTIONS
from qiip_tui._types import ProvisioningSource
from qiip_tui.screens import ConfirmModal, LogsScreen
from qiip_tui.screens._setup import SetupModal, SetupRequest

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from textual.app import App
    from textual.worker import Worker

    from qiip_tui._context import Selection
    from qiip_tui._operations import OperationTracker
    from qiip_tui._types import ConsoleClient

__all__ = ["HOST_ACTIONS", "HostActions"]

HOST_ACTIONS = ("setup", "cancel", "teardown", "power_on", "power_off", "power_restart")
"""What `HostActions.host_action` does."""

_POWER_BODIES = {
    "on": "Its BMC is asked to power it on.",
    "off": "Its BMC cuts the power at once: whatever it serves stops without draining.",
    "restart": "Its BMC is asked for a graceful restart: whatever it serves stops.",
}


class HostActions:
    """The console's host actions.

    Args:
        app: the app that shows the dialogs and notifications and runs the workers.
        client: the daemon's client; without provisioning (`ProvisioningSource`) every action says so.
        operations: where a started operation is followed.
        selection: the selection a started setup moves to its host.
    """

    def __init__(
        self, app: App[Any], client: ConsoleClient, operations: OperationTracker, selection: Selection
    ) -> None:
        self._app = app
        self._client = client
        self._operations = operations
        self._selection = selection

    def host_action(self, action: str, host: str | None = None) -> None:
        """Act on a host: `setup`, `cancel`, `teardown`, `power_on`, `power_off` or `power_restart`.

        Each asks first; a setup shows its form, then asks.

        Raises:
            ValueError: an unknown action.
        """
        if action not in HOST_ACTIONS:
            raise ValueError(f"Unknown host action {action!r}; the actions are {', '.join(HOST_ACTIONS)}.")
        app = self._app
        if not isinstance(self._client, ProvisioningSource):
            app.notify(f"{self._client.url} does not provision hosts.", severity="warning")
            return
        if action == "setup":
            app.push_screen(SetupModal(host or ""), callback=self._confirm_setup)
            return
        if host is None:
            app.notify("No host is selected: pick one in the provisioning table first.", severity="warning")
            return
        if action == "cancel":
            self._ask(
                f"Cancel the operation on {host}?",
                f"The setup or teardown running on {host} stops; its remote command is stopped and the host is left "
                "as it was then.",
                "Cancel it",
                partial(self._run, self._cancel, host),
            )
        elif action == "teardown":
            self._ask(
                f"Tear {host} down?",
                f"The node on {host} is drained and removed, and the engine this daemon set up there is stopped.",
                "Tear down",
                partial(self._run, self._teardown, host),
            )
        else:
            name = action.removeprefix("power_")
            label = POWER_ACTIONS[name][1]
            self._ask(f"{label} {host}?", _POWER_BODIES[name], label, partial(self._run, self._power, host, name))

    def _ask(self, title: str, body: str, confirm: str, then: Callable[[], object]) -> None:
        def answered(answer: bool | None) -> None:
            if answer is not None:
                then()

        self._app.push_screen(ConfirmModal(title, body, confirm=confirm), callback=answered)

    def _confirm_setup(self, request: SetupRequest | None) -> None:
        if request is None:
            return
        host, engine, model, sizing = request
        sized = (
            f" with {sizing['slots']} slot(s) of {sizing['context_per_slot']:,} tokens"
            if sizing is not None
            else " sized automatically"
        )
        self._ask(
            f"Set {host} up?",
            f"{host} is reached over SSH, {engine.label} is installed and started serving {model}{sized}, and the node "
            "joins the fleet. Its log shows on the provisioning screen.",
            "Set up",
            partial(self._run, self._setup, host, engine, model, sizing),
        )

    # -- workers -----------------------------------------------------------------------------------------

    def _run(self, work: Callable[..., Coroutine[Any, Any, None]], *args: object) -> Worker[None]:
        return self._app.run_worker(partial(work, *args), group="host-actions", exit_on_error=False)

    def _refused(self, what: str, host: str, error: ClientError) -> None:
        self._app.notify(f"{what} {host} refused: {error.message}", title=f"{what} {host}", severity="error")

    def _tasks_changed(self) -> None:
        # The screen polls anyway; asking now shows the new task without waiting for the next poll.
        screen = self._app.screen
        if isinstance(screen, LogsScreen):
            screen.refresh_tasks()

    async def _setup(self, host: str, engine: Engine, model: str, sizing: dict[str, Any] | None = None) -> None:
        client = self._client
        assert isinstance(client, ProvisioningSource)
        body: dict[str, Any] = {
            "hostname": host,
            "engine": engine.value,
            "model": model,
            "managed": True,
        }
        if sizing is not None:
            body["sizing"] = sizing
        try:
            operation = await client.setup(body)
        except ClientError as exc:
            self._refused("Set up", host, exc)
            return
        self._selection.host = host
        self._operations.track(operation)
        self._tasks_changed()

    async def _cancel(self, host: str) -> None:
        client = self._client
        assert isinstance(client, ProvisioningSource)
        try:
            operation = await client.cancel_provisioning(host)
        except ClientError as exc:
            self._refused("Cancel", host, exc)
            return
        self._operations.track(operation)
        self._tasks_changed()

    async def _teardown(self, host: str) -> None:
        try:
            operation = await self._client.remove(host)
        except ClientError as exc:
            self._refused("Tear down", host, exc)
            return
        self._operations.track(operation)
        self._tasks_changed()

    async def _power(self, host: str, name: str) -> None:
        client = self._client
        assert isinstance(client, ProvisioningSource)
        reset, label = POWER_ACTIONS[name]
        try:
            answer = await client.power(host, reset)
        except ClientError as exc:
            self._refused(label, host, exc)
            return
        state = answer.get("power_state")
        self._app.notify(
            f"{label} {host}: asked" + (f"; the host was {state}." if state else "."), title=f"{label} {host}"
        )
