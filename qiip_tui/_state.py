"""What the console remembers between runs (the theme, each screen's sort and filter), in
`$XDG_CONFIG_HOME/qiip/console-state.json`.

The file holds no secrets. It is written atomically (`qiip_core.storage.atomic_write`: a temporary file in the
same directory, fsynced, then a rename), so a console killed mid-write leaves the previous state, and a state file
that cannot be read is ignored: losing a preference must never keep the console from starting. `Preferences` is
the app's holder of the state: it writes each change in a thread worker, so no disk I/O runs on the UI thread.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qiip_core.storage import atomic_write

if TYPE_CHECKING:
    from textual.app import App
    from textual.worker import Worker

__all__ = ["ConsoleState", "Preferences", "ViewState", "default_state_path", "load_state", "save_state"]

logger = logging.getLogger("qiip.console")


class ViewState(BaseModel):
    """How the operator left one screen (or one pane of it): its sort and its filter."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    sort: str | None = Field(default=None, max_length=64)
    """The key of the column sorted by; None: the screen's default."""
    reverse: bool = False
    """Whether the sort is descending."""
    filter: str = Field(default="", max_length=200)
    """The filter or search typed; empty: none."""
    problems_only: bool = False
    """The fleet's problems-only switch (`e`)."""


class ConsoleState(BaseModel):
    """The remembered preferences."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    theme: str | None = None
    """The last theme chosen, by name."""
    views: dict[str, ViewState] = Field(default_factory=dict)
    """Each screen's sort and filter, by screen (`fleet`) or pane (`logs.timeline`)."""


def default_state_path(env: Mapping[str, str] | None = None) -> Path:
    """`$XDG_CONFIG_HOME/qiip/console-state.json`, or under `~/.config` when the variable is unset."""
    env = os.environ if env is None else env
    config_home = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config_home / "qiip" / "console-state.json"


def load_state(path: Path) -> ConsoleState:
    """The state in `path`; the defaults when it is missing or unreadable (logged)."""
    try:
        return ConsoleState.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return ConsoleState()
    except (OSError, ValidationError) as exc:
        logger.warning("ignoring the console state %s: %s", path, exc)
        return ConsoleState()


def save_state(path: Path, state: ConsoleState) -> None:
    """Write the state atomically.

    Raises:
        OSError: the directory cannot be created or written.
    """
    # Only what was chosen: the defaults stay out of the file.
    atomic_write(path, (json.dumps(state.model_dump(mode="json", exclude_defaults=True), indent=2) + "\n").encode())


class Preferences:
    """The app's remembered preferences: read once at start, written after each change.

    Args:
        app: the app whose thread worker writes the file, and which says when it cannot.
        path: the state file.
    """

    def __init__(self, app: App[Any], path: Path) -> None:
        self._app = app
        self.path = path
        """The state file."""
        self.state = load_state(path)
        """The preferences as they are now."""

    def view(self, name: str) -> ViewState:
        """How the screen or pane `name` was left (the defaults when it never was)."""
        return self.state.views.get(name) or ViewState()

    def remember_view(self, name: str, **changes: Any) -> None:
        """Change how the screen or pane `name` is left (`ViewState` fields), and write it."""
        if "filter" in changes:
            changes["filter"] = str(changes["filter"])[:200]  # what the file accepts back
        view = self.view(name).model_copy(update=changes)
        if view != self.view(name):
            self.remember(views={**self.state.views, name: view})

    def remember(self, **changes: Any) -> None:
        """Change some preferences (`ConsoleState` fields) and write them; the same values again write nothing."""
        state = self.state.model_copy(update=changes)
        if state != self.state:
            self.state = state
            self._save(state)

    def _save(self, state: ConsoleState) -> Worker[None]:
        return self._app.run_worker(
            partial(self._write, state), group="state", exclusive=True, thread=True, exit_on_error=False
        )

    def _write(self, state: ConsoleState) -> None:
        try:
            save_state(self.path, state)
        except OSError as exc:
            self._app.call_from_thread(self._app.notify, f"Cannot remember the preferences in {self.path}: {exc}.")
