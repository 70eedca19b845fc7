"""The console's connection to its daemon: following its events, retrying with backoff, and asking for the
admin password when the daemon refuses the one given.

```
_follow_events   worker: nodes(), then events(); retries with backoff   → FleetLoaded, NodeChanged, ConnectionLost
                 a 401 stops it: the connection screen asks, then `retry_with()` starts it again
```
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pydantic import SecretStr
from textual import work
from textual.signal import Signal

from qiip_core.client import ClientError, ConsoleConfig, DaemonUnreachable, Unauthorized
from qiip_tui._actions import ConsoleActions
from qiip_tui._connection import ConnectionProblem, describe_problem, retry_delay_s
from qiip_tui._messages import ConnectionLost, FleetLoaded, NodeChanged
from qiip_tui._types import CredentialsHolder

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["ConnectionWatch"]


class ConnectionWatch(ConsoleActions):
    """The app's connection state and the worker that keeps it. Subclasses set the attributes below."""

    config: ConsoleConfig
    connected: bool
    connection_problem: ConnectionProblem | None
    connection_attempt: tuple[int, float | None]
    connection_signal: Signal[None]
    retry_delays_s: Sequence[float]
    _mode_before_problem: str

    @property
    def connection_text(self) -> str:
        """The connection's state in a few words; empty while connected."""
        if self.connected:
            return ""
        if self.connection_problem is None:
            return f"Connecting to {self.client.url}…"
        if self.connection_problem.kind == "unauthorized":
            return f"Not connected to {self.client.url}: {self.connection_problem.title}"
        return f"Not connected to {self.client.url}: {self.connection_problem.title} Retrying."

    @work(exclusive=True, group="events", exit_on_error=False)
    async def _follow_events(self) -> None:
        attempt = 0
        while True:
            try:
                nodes = await self.client.nodes()
                self.post_message(FleetLoaded(nodes))
                attempt = 0
                async for event in self.client.events():
                    self.post_message(NodeChanged(event))
                error: ClientError = DaemonUnreachable(f"The daemon at {self.client.url} ended the event stream.")
            except ClientError as exc:
                error = exc
            attempt += 1
            if isinstance(error, Unauthorized):
                # Asking again with the same credentials cannot succeed, and each refusal counts against the
                # daemon's throttle: wait for the operator (the connection screen asks for a password).
                self.post_message(ConnectionLost(error, attempt=attempt, retry_in_s=None))
                return
            delay = retry_delay_s(attempt, self.retry_delays_s)
            self.post_message(ConnectionLost(error, attempt=attempt, retry_in_s=delay))
            await asyncio.sleep(delay)

    def action_reconnect(self) -> None:
        """Try the daemon again now."""
        self._follow_events()

    def retry_with(self, username: str, password: str) -> bool:
        """Connect again with other admin credentials (the daemon refused the ones given).

        Returns:
            False when the client cannot change its credentials.
        """
        client = self.client
        if not isinstance(client, CredentialsHolder):
            return False
        client.set_credentials(username, password)
        self.config = self.config.model_copy(
            update={"username": username, "password": SecretStr(password), "source": "the password typed here"}
        )
        self.connection_problem = None
        self.connection_signal.publish(None)
        self._follow_events()
        return True

    def on_connection_lost(self, message: ConnectionLost) -> None:
        """Say why the daemon cannot be used, and show the connection screen for a new outage."""
        config = self.config
        self.connected = False
        self.connection_problem = describe_problem(
            message.error, url=self.client.url, source=config.source, username=config.username
        )
        self.connection_attempt = (message.attempt, message.retry_in_s)
        self.connection_signal.publish(None)
        # Only a new outage takes over the screen; an operator who left it is not pulled back each retry.
        if message.attempt == 1 and self.current_mode != "connection":
            self._mode_before_problem = self.current_mode
            self.switch_mode("connection")
