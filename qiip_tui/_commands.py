"""The command palette's console commands (Ctrl+P): screens, node and host actions, coding-agent configs for each
model, themes, reconnecting.

Next to Textual's own system commands (quit, screenshot, …). Node actions name the node they act on, the one
selected in the fleet table or open in the node screen, so a palette search for "drain" says which node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from textual.command import DiscoveryHit, Hit, Hits, Provider

from qiip_core.clientconfig import ClientKind
from qiip_tui._client_configs import served_models, write_client_config_for
from qiip_tui._context import command_context

if TYPE_CHECKING:
    from textual.app import App

__all__ = ["ConsoleCommands", "PaletteCommand"]

_NODE_ACTIONS = (
    ("open", "Open node", "Show its devices, runtime record and errors"),
    ("describe", "Describe node", "Everything about it as text: state, errors, events, record; y copies it (d)"),
    ("drain", "Drain node", "Send it nothing new and let its requests finish (asks first)"),
    ("undrain", "Undrain node", "Take it back into rotation"),
    ("remove", "Remove node", "Drain, then remove it from the fleet (asks first)"),
    ("relaunch", "Relaunch node", "Open the llama.cpp sizing editor"),
    ("power", "Power node", "Power control through the node's BMC"),
)

_HOST_ACTIONS = (
    ("cancel", "Cancel provisioning", "Stop the setup or teardown running on it (asks first)"),
    ("teardown", "Tear down", "Remove its node and stop its engine (asks first)"),
    ("power_on", "Power on", "Through the host's BMC (asks first)"),
    ("power_off", "Power off", "Through the host's BMC, at once (asks first)"),
    ("power_restart", "Restart", "A graceful restart through the host's BMC (asks first)"),
)


@dataclass(frozen=True)
class PaletteCommand:
    """One command the palette offers."""

    name: str
    """What the palette shows and matches."""
    run: Callable[[], object]
    """What choosing it does."""
    help: str
    """The line under it."""


def console_commands(app: App[Any]) -> list[PaletteCommand]:
    """Every console command available now: screens, the selected node's actions, client configs, themes."""
    console = command_context(app)
    commands = [
        PaletteCommand("Fleet", console.action_fleet, "The fleet table (f)"),
        PaletteCommand("Chat", console.action_chat, "Talk to a model through the daemon (c)"),
        PaletteCommand(
            "Logs", console.action_logs, "The fleet's timeline, engine logs, and provisioning as they happen (l)"
        ),
        PaletteCommand("Set up a host", partial(console.host_action, "setup", None), "Install an engine over SSH (s)"),
        PaletteCommand("Models", console.action_models, "The model cache catalog and downloads (m)"),
        PaletteCommand(
            "Deployments", console.action_deployments, "Replicas, events and autoscaling; scale, undo, delete (a)"
        ),
        PaletteCommand("Keys", console.action_help, "The key map of this screen (?)"),
        PaletteCommand("Command line", console.action_command_line, "drain NODE, node NODE, model M, … (:)"),
        PaletteCommand("Reconnect", console.action_reconnect, f"Connect to {console.client.url} again now"),
    ]
    node = console.selection.node
    if node is not None and node in console.fleet.nodes:
        for action, label, help_text in _NODE_ACTIONS:
            commands.append(PaletteCommand(f"{label} {node}", partial(console.node_action, action, node), help_text))
    host = console.selection.host
    if host is not None:
        for action, label, help_text in _HOST_ACTIONS:
            commands.append(PaletteCommand(f"{label} {host}", partial(console.host_action, action, host), help_text))
    for model in served_models(console.fleet):
        for kind in ClientKind:
            commands.append(
                PaletteCommand(
                    f"Client config: {kind.value} for {model}",
                    partial(write_client_config_for, app, kind, model),
                    "Write the file the coding agent reads to use this model through the gateway",
                )
            )
    for name in sorted(console.console_themes):
        commands.append(
            PaletteCommand(f"Theme: {name}", partial(console.set_theme, name), "Switch the console's theme")
        )
    return commands


class ConsoleCommands(Provider):
    """The console's commands for the command palette."""

    async def discover(self) -> Hits:
        for command in console_commands(self.app):
            yield DiscoveryHit(command.name, command.run, help=command.help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for command in console_commands(self.app):
            score = matcher.match(command.name)
            if score > 0:
                yield Hit(score, matcher.highlight(command.name), command.run, text=command.name, help=command.help)
