"""The operations the console started (drain, remove, relaunch, setup, …), followed to their end.

`OperationTracker` is a read-only mapping of them by id. `track()` shows one at once and, while it runs, polls
`client.operation(id)` in a worker that posts each change to the app (`OperationUpdated`); the app hands the
message back to `updated()`, which keeps the record, publishes it on `signal` for the screens, and says how it
ended with `notify()`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from textual.signal import Signal

from qiip_core.client import ClientError, DaemonUnreachable, OperationInfo
from qiip_tui._messages import OperationUpdated

if TYPE_CHECKING:
    from textual.app import App
    from textual.worker import Worker

    from qiip_tui._types import ConsoleClient

__all__ = ["OperationTracker"]

_POLL_FAILURES = 20
"""Failed polls in a row after which the console stops following an operation (the daemon is gone)."""


class OperationTracker(Mapping[str, OperationInfo]):
    """The operations started from this console, by id.

    Args:
        app: the app that runs the polling workers, receives `OperationUpdated` and shows notifications.
        client: the daemon's client.
        poll_s: seconds between polls of a running operation.
    """

    def __init__(self, app: App[Any], client: ConsoleClient, *, poll_s: float) -> None:
        self._app = app
        self._client = client
        self.poll_s = poll_s
        self._operations: dict[str, OperationInfo] = {}
        self.signal: Signal[OperationInfo] = Signal(app, "operation")
        """Published when an operation the console follows changes."""

    def __getitem__(self, operation_id: str) -> OperationInfo:
        return self._operations[operation_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._operations)

    def __len__(self) -> int:
        return len(self._operations)

    def track(self, operation: OperationInfo) -> None:
        """Show an operation the console started, and follow it to its end."""
        self._app.post_message(OperationUpdated(operation))
        if operation.state == "running":
            self._start_following(operation)

    def _start_following(self, operation: OperationInfo) -> Worker[None]:
        return self._app.run_worker(partial(self._follow, operation), group="operations", exit_on_error=False)

    async def _follow(self, operation: OperationInfo) -> None:
        notify = self._app.notify
        failures = 0
        while operation.state == "running" and failures < _POLL_FAILURES:
            await asyncio.sleep(self.poll_s)
            try:
                current = await self._client.operation(operation.id)
            except DaemonUnreachable:
                failures += 1
                continue
            except ClientError as exc:
                notify(exc.message, title=f"{operation.kind} {operation.node_id}", severity="error")
                return
            failures = 0
            if current != operation:
                operation = current
                self._app.post_message(OperationUpdated(current))
        if failures:
            notify(
                f"Lost track of {operation.kind} {operation.id}: the daemon does not answer.",
                title=f"{operation.kind} {operation.node_id}",
                severity="warning",
            )

    def updated(self, operation: OperationInfo) -> None:
        """Keep `operation` as it is now (`OperationUpdated`), publish it, and say how it ended once it has."""
        before = self._operations.get(operation.id)
        self._operations[operation.id] = operation
        self.signal.publish(operation)
        if operation.state == "running" or (before is not None and before.state == operation.state):
            return
        title = f"{operation.kind.capitalize()} {operation.node_id}"
        if operation.state == "succeeded":
            self._app.notify(f"{operation.kind} of {operation.node_id} succeeded.", title=title)
        else:
            self._app.notify(operation.error or f"{operation.kind} failed.", title=f"{title} failed", severity="error")
