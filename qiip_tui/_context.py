"""What the console's screens and commands use of the app, as protocols, so that none of them imports the app.

```
QiipConsole ──holds──▶ ConnectionWatch, OperationTracker, NodeActions, HostActions, Selection
     ▲ implements
ConsoleContext    what a screen uses: the client, the fleet and its signal, the connection, the operations,
                  the clocks, the selection, and the node and host actions by name
CommandContext    what the command palette and the `:` line add: the screens by name, themes, reconnecting
```

The screens reach the app as `ConsoleScreen.console`, typed `ConsoleContext`; the palette and the command line
through `command_context(app)`. The app module imports the screens, never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from datetime import datetime

    from textual.app import App
    from textual.signal import Signal
    from textual.theme import Theme

    from qiip_core.client import ConsoleConfig
    from qiip_tui._connection_watch import ConnectionWatch
    from qiip_tui._fleet import Fleet, FleetDelta
    from qiip_tui._operations import OperationTracker
    from qiip_tui._state import Preferences
    from qiip_tui._types import Clock, ConsoleClient

__all__ = ["CommandContext", "ConsoleContext", "Selection", "command_context"]


@dataclass
class Selection:
    """What the palette's node and host commands act on: the node highlighted in the fleet table or open, the
    host highlighted in the provisioning table (or last set up)."""

    node: str | None = None
    """The node the palette's node commands act on."""
    host: str | None = None
    """The host the palette's host commands act on."""


class ConsoleContext(Protocol):
    """What a console screen uses of the app; `QiipConsole` implements it."""

    @property
    def client(self) -> ConsoleClient:
        """The daemon's client."""

    @property
    def fleet(self) -> Fleet:
        """Every node the daemon reported, kept current."""

    @property
    def fleet_signal(self) -> Signal[FleetDelta]:
        """Published with the nodes that changed, at most once per batch of messages."""

    @property
    def connection(self) -> ConnectionWatch:
        """The connection's state, its signal, and new credentials."""

    @property
    def operations(self) -> OperationTracker:
        """The operations started from this console."""

    @property
    def selection(self) -> Selection:
        """The node and host the palette's commands act on."""

    @property
    def preferences(self) -> Preferences:
        """What the console remembers between runs: each screen's sort and filter."""

    @property
    def clock(self) -> Clock:
        """A monotonic clock in seconds."""

    @property
    def wall_clock(self) -> Callable[[], datetime]:
        """The time of day (UTC)."""

    @property
    def last_update(self) -> datetime | None:
        """When the daemon last told the console something, UTC."""

    @property
    def node_poll_s(self) -> float:
        """Seconds between polls of the node a screen shows."""

    @property
    def chat_max_tokens(self) -> int | None:
        """`max_tokens` of chat requests."""

    engine_log_node: str | None
    """A node whose engine log the logs screen opens next; the screen clears it."""

    def node_action(self, action: str, node_id: str | None) -> None:
        """Act on a node (`NodeActions.node_action`)."""

    def nodes_action(self, action: str, node_ids: Sequence[str], *, then: Callable[[], object] | None = None) -> None:
        """Drain, undrain or remove several nodes after one confirmation (`NodeActions.nodes_action`)."""

    def host_action(self, action: str, host: str | None = None) -> None:
        """Act on a host (`HostActions.host_action`)."""

    def open_node(self, node_id: str) -> None:
        """Show a node's screen."""


class CommandContext(ConsoleContext, Protocol):
    """What the command palette and the `:` command line use of the app besides a screen's `ConsoleContext`."""

    @property
    def config(self) -> ConsoleConfig:
        """Where the daemon is, and the credentials."""

    @property
    def console_themes(self) -> Mapping[str, Theme]:
        """The themes read from files, by name."""

    def set_theme(self, name: str) -> None:
        """Switch the theme."""

    def action_fleet(self) -> None:
        """Show the fleet."""

    def action_chat(self) -> None:
        """Show the chat."""

    def action_logs(self) -> None:
        """Show the logs."""

    def action_models(self) -> None:
        """Show the models."""

    def action_deployments(self) -> None:
        """Show the deployments."""

    def action_help(self) -> None:
        """Show the key map."""

    def action_command_line(self) -> None:
        """Open the command line."""

    def action_reconnect(self) -> None:
        """Try the daemon again now."""


def command_context(app: App[Any]) -> CommandContext:
    """The console's side of `app` (the running `QiipConsole`), for code that Textual hands only the `App`."""
    return cast("CommandContext", app)
