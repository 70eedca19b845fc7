"""What the console remembers between runs (the theme), in `$XDG_CONFIG_HOME/qiip/console-state.json`.

The file holds no secrets. It is written atomically (`qiip_core.storage.atomic_write`: a temporary file in the
same directory, fsynced, then a rename), so a console killed mid-write leaves the previous state, and a state file
that cannot be read is ignored: losing a preference must never keep the console from starting.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from qiip_core.storage import atomic_write

__all__ = ["ConsoleState", "default_state_path", "load_state", "save_state"]

logger = logging.getLogger("qiip.console")


class ConsoleState(BaseModel):
    """The remembered preferences."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    theme: str | None = None
    """The last theme chosen, by name."""


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
    atomic_write(path, (json.dumps(state.model_dump(mode="json"), indent=2) + "\n").encode())
