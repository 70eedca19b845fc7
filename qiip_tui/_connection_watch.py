"""The console's connection to its daemon: following its events, retrying with backoff, and asking for the
admin password when the daemon refuses the one given.

```
ConnectionWatch.follow()   worker: nodes(), then events(); retries with backoff  → FleetLoaded, NodeChanged,
                           a 401 stops it: the connection screen asks,            ConnectionLost (to the app)
                           then `retry_with()` starts it again
```

The app holds one and hands it the worker's messages back (`answered`, `lost`): the fleet and the connection's
state change in the order the messages were posted, on the UI thread.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr
from textual.signal import Signal

from qiip_core.client import ClientError, ConsoleConfig, DaemonUnreachable, Unauthorized
from qiip_tui._connection import RETRY_DELAYS_S, ConnectionProblem, describe_problem, retry_delay_s
from qiip_tui._messages import ConnectionLost, FleetLoaded, NodeChanged
from qiip_tui._types import CredentialsHolder

if TYPE_CHECKING:
    from collections.abc import Sequence

    from textual.app import App
    from textual.worker import Worker

    from qiip_tui._types import ConsoleClient

__all__ = ["ConnectionWatch"]

CONNECTION_MODE = "connection"
"""The app mode that shows the connection screen."""


class ConnectionWatch:
    """The connection's state and the worker that keeps it.

    Args:
        app: the app whose workers follow the daemon and which receives their messages.
        client: the daemon's client.
        config: where the daemon is and where the credentials came from.
        retry_delays_s: seconds between connection attempts, growing; the last one repeats.
    """

    def __init__(
        self,
        app: App[Any],
        client: ConsoleClient,
        config: ConsoleConfig,
        *,
        retry_delays_s: Sequence[float] = RETRY_DELAYS_S,
    ) -> None:
        self._app = app
        self.client = client
        self.config = config
        """Where the daemon is, and where the credentials came from (the password typed here, once typed)."""
        self.retry_delays_s = tuple(retry_delays_s)
        """Seconds between attempts; tests and snapshots stretch them."""
        self.connected = False
        """Whether the daemon answered the last attempt."""
        self.problem: ConnectionProblem | None = None
        """Why the last attempt failed."""
        self.attempt: tuple[int, float | None] = (0, 0.0)
        """Failed attempts in a row, and seconds until the next (None: the console waits for the operator)."""
        self.signal: Signal[None] = Signal(app, "connection")
        """Published when the connection's state changes."""
        self._mode_before_problem = "fleet"

    @property
    def text(self) -> str:
        """The connection's state in a few words; empty while connected."""
        if self.connected:
            return ""
        if self.problem is None:
            return f"Connecting to {self.client.url}…"
        if self.problem.kind == "unauthorized":
            return f"Not connected to {self.client.url}: {self.problem.title}"
        return f"Not connected to {self.client.url}: {self.problem.title} Retrying."

    def follow(self) -> Worker[None]:
        """Follow the daemon from now: its fleet, then its events; a follow already running starts over.

        Returns:
            The worker that follows it.
        """
        # The method, not a coroutine: a worker cancelled before it starts leaves no coroutine never awaited.
        return self._app.run_worker(self._follow_events, group="events", exclusive=True, exit_on_error=False)

    async def _follow_events(self) -> None:
        attempt = 0
        post = self._app.post_message
        while True:
            try:
                nodes = await self.client.nodes()
                post(FleetLoaded(nodes))
                attempt = 0
                async for event in self.client.events():
                    post(NodeChanged(event))
                error: ClientError = DaemonUnreachable(f"The daemon at {self.client.url} ended the event stream.")
            except ClientError as exc:
                error = exc
            attempt += 1
            if isinstance(error, Unauthorized):
                # Asking again with the same credentials cannot succeed, and each refusal counts against the
                # daemon's throttle: wait for the operator (the connection screen asks for a password).
                post(ConnectionLost(error, attempt=attempt, retry_in_s=None))
                return
            delay = retry_delay_s(attempt, self.retry_delays_s)
            post(ConnectionLost(error, attempt=attempt, retry_in_s=delay))
            await asyncio.sleep(delay)

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
        self.problem = None
        self.signal.publish(None)
        self.follow()
        return True

    def answered(self) -> bool:
        """The daemon answered with its fleet (`FleetLoaded`): connected, and back to the screen the outage took
        over.

        Returns:
            True when the console was not connected before: the app then asks for everything else at once.
        """
        if self.connected:
            return False
        self.connected, self.problem, self.attempt = True, None, (0, 0.0)
        self.signal.publish(None)
        if self._app.current_mode == CONNECTION_MODE and self._app.is_running:
            self._app.switch_mode(self._mode_before_problem)
        return True

    def lost(self, message: ConnectionLost) -> None:
        """Say why the daemon cannot be used (`ConnectionLost`), and show the connection screen for a new outage."""
        config = self.config
        self.connected = False
        self.problem = describe_problem(
            message.error, url=self.client.url, source=config.source, username=config.username
        )
        self.attempt = (message.attempt, message.retry_in_s)
        self.signal.publish(None)
        # Only a new outage takes over the screen; an operator who left it is not pulled back each retry.
        # An app shutting down takes no new screen: Textual closes its screen stacks then, and a mode switched to
        # in that moment would change them under it (quitting while the first attempt failed crashed the exit).
        current = self._app.current_mode
        if message.attempt == 1 and current != CONNECTION_MODE and self._app.is_running:
            self._mode_before_problem = current
            self._app.switch_mode(CONNECTION_MODE)
