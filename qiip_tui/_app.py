"""The operator console: a Textual app that shows and operates a QIIP fleet through its daemon.

```
QiipConsole(config)                        the app; talks to the daemon only (ConsoleClient)
├── modes: fleet (FleetScreen → NodeScreen → SizingScreen), chat, logs, models, deployments, connection
├── connection      ConnectionWatch: nodes(), then events(); retries with backoff → FleetLoaded, NodeChanged,
│                                                                                  ConnectionLost
├── operations      OperationTracker: polls the operations the console started   → OperationUpdated
├── actions         NodeActions: drain, undrain, remove, relaunch, power, open
├── host_actions    HostActions: set up, cancel, tear down, power a host
├── feed            FleetFeed: the metrics and QUADS polls                        → MetricsPolled,
│                   the fleet and its batched changes for the screens (FleetDelta)   LentHostsPolled
└── preferences     Preferences: the theme, each screen's sort and filter, between runs
```

The app holds its collaborators; the screens see it through `ConsoleContext`, a protocol of what they use, so
no screen imports this module. Workers only await the client and post messages (`qiip_tui._messages`); the
handlers here hand each to the collaborator it concerns, in the order posted, so no screen polls and no I/O runs
on the UI thread.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from textual import events
from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.theme import Theme

from qiip_core.client import DEFAULT_URL, ConsoleConfig, QiipClient
from qiip_tui._commands import ConsoleCommands
from qiip_tui._connection import RETRY_DELAYS_S
from qiip_tui._connection_watch import ConnectionWatch
from qiip_tui._context import CommandContext, Selection
from qiip_tui._fleet_feed import FleetFeed
from qiip_tui._host_actions import HostActions
from qiip_tui._key_router import KeyRouter
from qiip_tui._messages import (
    ConnectionLost,
    FleetLoaded,
    LentHostsPolled,
    MetricsPolled,
    NodeChanged,
    NodePolled,
    OperationUpdated,
)
from qiip_tui._node_actions import NodeActions
from qiip_tui._operations import OperationTracker
from qiip_tui._state import Preferences, default_state_path
from qiip_tui._themes import THEME_DIRS, ThemeFileError, console_variable_defaults, load_themes
from qiip_tui._types import Clock, ConsoleClient
from qiip_tui.screens import (
    ChatScreen,
    CommandLine,
    ConnectionScreen,
    DeploymentsScreen,
    FleetScreen,
    HelpScreen,
    LogsScreen,
    ModelsScreen,
    NodeScreen,
    SizingScreen,
    key_map,
    run_command,
    screen_name,
)
from qiip_tui.screens._base import ConsoleScreen
from qiip_tui.widgets import FleetTable

__all__ = ["QiipConsole"]


def _freeze_long_lived() -> None:
    # Once the first fleet is shown, the app, its screens and the fleet live as long as the process. Moving them
    # out of the collector's reach keeps full collections short: with a thousand nodes they otherwise scan
    # everything and stall the UI for about 100 ms several times a minute.
    gc.collect()
    gc.freeze()


DEFAULT_THEME = "dark"
"""The theme of a first start, when `themes/dark.toml` is found."""


def _user_theme_dir() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "qiip" / "themes"


class QiipConsole(App[None]):
    """The operator console.

    Args:
        config: where the daemon is and the credentials (`load_console_config()`).
        url: the daemon's URL, when no `config` is given (no credentials then).
        client: a client to use instead of one built from `config` (the console does not close it).
        state_path: the remembered-preferences file (default `$XDG_CONFIG_HOME/qiip/console-state.json`).
        theme_dirs: where theme files are read, later directories winning (default: the shipped themes,
            then `$XDG_CONFIG_HOME/qiip/themes`).
        clock: a monotonic clock in seconds, for rates and histories.
        wall_clock: the time of day (UTC), for the age of errors and of the data shown (default: now).
        retry_delays_s: seconds between connection attempts, growing; the last one repeats.
        metrics_interval_s: seconds between polls of the metrics and the nodes' live values.
        operation_poll_s: seconds between polls of an operation the console follows.
        node_poll_s: seconds between polls of the node the node screen shows.
        chat_max_tokens: `max_tokens` of chat requests (None: the node's default).
    """

    TITLE = "QIIP"
    CSS_PATH = "console.tcss"
    MODES: ClassVar[dict[str, str | Callable[[], Screen[Any]]]] = {
        "fleet": FleetScreen,
        "chat": ChatScreen,
        "logs": LogsScreen,
        "models": ModelsScreen,
        "deployments": DeploymentsScreen,
        "connection": ConnectionScreen,
    }
    DEFAULT_MODE = "fleet"
    COMMANDS = App.COMMANDS | {ConsoleCommands}
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("f", "fleet", "Fleet"),
        Binding("c", "chat", "Chat"),
        Binding("l", "logs", "Logs"),
        Binding("m", "models", "Models"),
        Binding("a", "deployments", "Deployments"),
        Binding("question_mark", "help", "Keys"),
        Binding("colon", "command_line", "Command"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | f | The fleet. |
    | c | Chat. |
    | l | Logs: the fleet's timeline, engine logs (of the open node, on a node's screen), provisioning. |
    | m | Models: the cache catalog and downloads. |
    | a | Deployments: replicas, events, autoscaling; scale, rollout undo, delete. |
    | ? | The keys of this screen. |
    | : | The command line (`:drain NODE`, `:node NODE`, `:model M`, …). |
    | ctrl+p | The command palette. |
    """

    def __init__(
        self,
        config: ConsoleConfig | None = None,
        *,
        url: str | None = None,
        client: ConsoleClient | None = None,
        state_path: Path | None = None,
        theme_dirs: Sequence[Path] | None = None,
        clock: Clock = time.monotonic,
        wall_clock: Callable[[], datetime] | None = None,
        retry_delays_s: Sequence[float] = RETRY_DELAYS_S,
        metrics_interval_s: float = 5.0,
        operation_poll_s: float = 0.5,
        node_poll_s: float = 2.0,
        chat_max_tokens: int | None = 512,
    ) -> None:
        super().__init__()
        config = config or ConsoleConfig(url=url or DEFAULT_URL)
        self._owns_client = client is None
        self.client: ConsoleClient = client or QiipClient.from_config(config)
        self.clock = clock
        self.wall_clock: Callable[[], datetime] = wall_clock or (lambda: datetime.now(UTC))
        """The time of day (UTC) ages are measured against."""
        self.metrics_interval_s = metrics_interval_s
        self.node_poll_s = node_poll_s
        self.chat_max_tokens = chat_max_tokens
        self.selection = Selection()
        """The node and host the palette's commands act on."""
        self.engine_log_node: str | None = None
        """A node whose engine log the logs screen opens next (`l` on a node's screen)."""
        self.connection = ConnectionWatch(self, self.client, config, retry_delays_s=retry_delays_s)
        """The connection's state, the worker that keeps it, and new credentials."""
        self.feed = FleetFeed(self, self.client, self.connection, clock=clock, wall_clock=self.wall_clock)
        """The fleet, kept current from the daemon's events and the metrics polls."""
        self.fleet = self.feed.fleet
        """Every node the daemon reported, kept current by the feed."""
        self.fleet_signal = self.feed.signal
        """Published with the nodes that changed, at most once per batch of messages."""
        self.operations = OperationTracker(self, self.client, poll_s=operation_poll_s)
        """The operations started from this console, by id, followed to their end."""
        self.actions = NodeActions(
            self, self.client, self.fleet, self.operations, self.selection, node_poll_s=node_poll_s
        )
        """Drain, undrain, remove, relaunch, power and open a node."""
        self.host_actions = HostActions(self, self.client, self.operations, self.selection)
        """Set up, cancel, tear down and power a host."""
        self._keys = KeyRouter(self)
        self._frozen = False
        self.preferences = Preferences(self, state_path or default_state_path())
        """The theme and each screen's sort and filter, remembered between runs."""
        dirs = list(theme_dirs) if theme_dirs is not None else [*THEME_DIRS, _user_theme_dir()]
        themes, self.theme_errors = load_themes(dirs)
        self.console_themes: dict[str, Theme] = {theme.name: theme for theme in themes}
        """The themes read from files, by name."""
        for theme in themes:
            self.register_theme(theme)

    # -- start and stop ----------------------------------------------------------------------------------

    def get_theme_variable_defaults(self) -> dict[str, str]:
        # Textual's own themes do not know the console's variables: derive them from the theme's colours.
        return console_variable_defaults(self.current_theme.to_color_system().generate())

    def on_mount(self) -> None:
        self.sub_title = self.client.url
        wanted = self.preferences.state.theme
        for name in (wanted, DEFAULT_THEME):
            if name and name in self.available_themes:
                self.theme = name
                break
        self.theme_changed_signal.subscribe(self, self._remember_theme)
        if len(self.theme_errors) > 2:
            # One notification rather than a stack of them over the table.
            names = ", ".join(error.path.name for error in self.theme_errors)
            first = self.theme_errors[0].message
            message = f"{len(self.theme_errors)} theme files skipped: {names}. The first: {first}"
            self.notify(message, title="Theme files skipped", severity="warning", timeout=15)
        else:
            for error in self.theme_errors:
                self.notify(error.message, title="Theme file skipped", severity="warning", timeout=10)
        self.connection.follow()
        self.set_interval(self.metrics_interval_s, self.feed.poll_metrics)

    async def on_unmount(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    def set_theme(self, name: str) -> None:
        """Switch to the theme `name` (remembered for the next start).

        Raises:
            ThemeFileError: no theme has that name.
        """
        if name not in self.available_themes:
            raise ThemeFileError(f"There is no theme named {name!r}.", path=self.preferences.path)
        self.theme = name

    def _remember_theme(self, theme: Theme) -> None:
        self.preferences.remember(theme=theme.name)

    # -- keys ----------------------------------------------------------------------------------------------

    async def on_event(self, event: events.Event) -> None:
        if isinstance(event, events.Key) and not event.is_forwarded:
            self._keys.handed(event)
        await super().on_event(event)

    async def _on_key(self, event: events.Key) -> None:
        # A key no widget used: where the focus moved since it arrived, it belongs to the widget focused now, and
        # `App._on_key` (next in the MRO: Textual calls each class's handler) does not run its bindings.
        if self._keys.returned(event):
            event.prevent_default()

    # -- what the workers post ----------------------------------------------------------------------------

    def on_fleet_loaded(self, message: FleetLoaded) -> None:
        self.feed.loaded(message.nodes)
        if not self._frozen:
            # After the screens have built their rows from this first fleet.
            self._frozen = True
            self.set_timer(1.0, _freeze_long_lived)
        if self.connection.answered():
            self.feed.reconnected()

    def on_connection_lost(self, message: ConnectionLost) -> None:
        self.connection.lost(message)

    def on_node_changed(self, message: NodeChanged) -> None:
        self.feed.changed(message.event)

    def on_metrics_polled(self, message: MetricsPolled) -> None:
        self.feed.metrics_polled(message)

    def on_lent_hosts_polled(self, message: LentHostsPolled) -> None:
        self.feed.lent_polled(message.lent)

    def on_node_polled(self, message: NodePolled) -> None:
        self.feed.node_polled(message.node)

    def on_operation_updated(self, message: OperationUpdated) -> None:
        self.operations.updated(message.operation)

    # -- navigation --------------------------------------------------------------------------------------

    def on_fleet_table_node_highlighted(self, message: FleetTable.NodeHighlighted) -> None:
        self.selection.node = message.node_id

    def action_fleet(self) -> None:
        """Show the fleet (from the node screen too)."""
        if self.current_mode == "fleet":
            while len(self.screen_stack) > 1:
                self.pop_screen()
        else:
            self.switch_mode("fleet")

    def action_chat(self) -> None:
        """Show the chat."""
        self.switch_mode("chat")

    def action_logs(self) -> None:
        """Show the logs screen: the fleet's timeline, engine logs and provisioning; from a node's screen, that
        node's engine log."""
        if isinstance(self.screen, NodeScreen):
            self.engine_log_node = self.screen.node_id
        self.switch_mode("logs")  # the screen opens the requested node when it mounts or resumes

    def action_models(self) -> None:
        """Show the models: the cache catalog and downloads."""
        self.switch_mode("models")

    def action_deployments(self) -> None:
        """Show the deployments: their replicas, events and autoscaling."""
        self.switch_mode("deployments")

    def get_system_commands(self, screen: Screen[object]) -> Iterable[SystemCommand]:
        # Textual's "Keys" (its help panel) would sit beside the console's own key map under the same name.
        return (command for command in super().get_system_commands(screen) if command.title != "Keys")

    def action_help(self) -> None:
        """Show the keys of the current screen."""
        if isinstance(self.screen, HelpScreen):
            return
        rows = key_map(
            self.screen.active_bindings.values(),
            key_display={b.binding.key: self.get_key_display(b.binding) for b in self.screen.active_bindings.values()},
        )
        self.push_screen(HelpScreen(rows, title=screen_name(self.screen)))

    def action_command_line(self) -> None:
        """Open the `:` command line over a main screen (not over the sizing editor, a dialog or the key map)."""
        if isinstance(self.screen, ConsoleScreen) and not isinstance(self.screen, SizingScreen):
            self.push_screen(CommandLine(self.fleet), partial(run_command, self))

    # -- what the screens and commands use (`ConsoleContext`, `CommandContext`) ------------------------------

    @property
    def last_update(self) -> datetime | None:
        """When the daemon last told the console something (a snapshot, an event, a poll), UTC."""
        return self.feed.last_update

    @property
    def config(self) -> ConsoleConfig:
        """Where the daemon is, and where the credentials came from (the password typed here, once typed)."""
        return self.connection.config

    def action_reconnect(self) -> None:
        """Try the daemon again now."""
        self.connection.follow()

    def node_action(self, action: str, node_id: str | None) -> None:
        """Act on a node (`NodeActions.node_action`): `open`, `drain`, `undrain`, `remove`, `relaunch`, `power`.

        Raises:
            ValueError: an unknown action.
        """
        self.actions.node_action(action, node_id)

    def nodes_action(self, action: str, node_ids: Sequence[str], *, then: Callable[[], object] | None = None) -> None:
        """Drain, undrain or remove several nodes after one confirmation (`NodeActions.nodes_action`).

        Raises:
            ValueError: another action.
        """
        self.actions.nodes_action(action, node_ids, then=then)

    def open_node(self, node_id: str) -> None:
        """Show the node screen of `node_id` (in the fleet mode)."""
        self.actions.open_node(node_id)

    def host_action(self, action: str, host: str | None = None) -> None:
        """Act on a host (`HostActions.host_action`): `setup`, `cancel`, `teardown`, `power_on`, `power_off`,
        `power_restart`.

        Raises:
            ValueError: an unknown action.
        """
        self.host_actions.host_action(action, host)


if TYPE_CHECKING:
    # The app is what its screens and commands are typed against; mypy checks that it still is.
    def _implements(app: QiipConsole) -> CommandContext:
        return app
