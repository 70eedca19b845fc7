"""Console themes: data files in `themes/`, validated through a pydantic model into `textual.theme.Theme`.

A theme file is TOML (or JSON with the same keys); its stem is the theme's name unless it says `name`:

```toml
dark = true
primary = "#4f9fdf"
background = "#101418"
# …secondary, accent, warning, error, success, foreground, surface, panel, boost: optional
[variables]
status-healthy = "#4ebf71"        # every key of CONSOLE_VARIABLES may be set; the rest derive from the theme
```

Widgets never name a colour: they use the variables of `CONSOLE_VARIABLES` (`$status-healthy`, …), which a
theme may set and which otherwise derive from its semantic colours (success, error, warning, …), so Textual's
built-in themes work too. A file that is not valid TOML/JSON, has an unknown key or a value that is not a
colour raises `ThemeFileError` naming the file and the field.
"""

from __future__ import annotations

import json
import logging
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from textual.color import Color, ColorParseError
from textual.theme import Theme

from qiip_core import ConfigError
from qiip_core._violation import first_violation

__all__ = [
    "CONSOLE_VARIABLES",
    "THEME_DIRS",
    "ThemeFile",
    "ThemeFileError",
    "console_variable_defaults",
    "load_theme_file",
    "load_themes",
]

logger = logging.getLogger("qiip.console")

THEME_DIRS: tuple[Path, ...] = (
    Path(__file__).parent / "themes",
    Path(__file__).resolve().parent.parent / "themes",
)
"""Where the shipped themes are looked for: inside the package when installed, else the source tree's `themes/`."""

CONSOLE_VARIABLES: dict[str, str] = {
    "status-healthy": "success",
    "status-unhealthy": "error",
    "status-draining": "warning",
    "status-relaunching": "accent",
    "status-relaunch-failed": "error",
    "status-provisioning": "secondary",
    "status-failed": "error",
    "status-unknown": "foreground-muted",
    "breaker-closed": "success",
    "breaker-half-open": "warning",
    "breaker-open": "error",
    "meter-used": "primary",
    "meter-free": "panel",
    "log-debug": "foreground-muted",
    "log-info": "foreground",
    "log-warning": "warning",
    "log-error": "error",
}
"""The console's own theme variables, each with the Textual colour-system variable it defaults to."""


class ThemeFileError(ConfigError):
    """A theme file cannot be used (422 `invalid_theme`).

    Attributes:
        path: the file.
    """

    status = 422
    code = "invalid_theme"

    def __init__(self, message: str, *, path: Path) -> None:
        super().__init__(message)
        self.path = path


def _colour(value: str) -> str:
    try:
        Color.parse(value)
    except ColorParseError as exc:
        raise ValueError(f"{value!r} is not a colour (use #rrggbb, rgb(r, g, b) or a colour name)") from exc
    return value


class ThemeFile(BaseModel):
    """The contents of a theme file: Textual's `Theme` fields, colours checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9-]*$")
    """The theme's name; the file's stem when absent."""
    dark: bool = True
    """Whether it is a dark theme (Textual derives shades the other way for a light one)."""
    primary: str
    """The main accent: focus, the header, the cursor."""
    secondary: str | None = None
    """A second accent."""
    accent: str | None = None
    """Highlights."""
    warning: str | None = None
    """Warnings; `$status-draining` defaults to it."""
    error: str | None = None
    """Errors; `$status-unhealthy` defaults to it."""
    success: str | None = None
    """Success; `$status-healthy` defaults to it."""
    foreground: str | None = None
    """Text."""
    background: str | None = None
    """The screen's background."""
    surface: str | None = None
    """Widgets' background."""
    panel: str | None = None
    """Panels' background."""
    boost: str | None = None
    """A translucent colour layered to lift a widget."""
    variables: dict[str, str] = Field(default_factory=dict)
    """Extra variables: `CONSOLE_VARIABLES` names (colours) and any Textual variable (CSS values)."""

    @field_validator("primary", "secondary", "accent", "warning", "error", "success", "foreground")
    @classmethod
    def _colours(cls, value: str | None) -> str | None:
        return None if value is None else _colour(value)

    @field_validator("background", "surface", "panel", "boost")
    @classmethod
    def _backgrounds(cls, value: str | None) -> str | None:
        return None if value is None else _colour(value)

    @field_validator("variables")
    @classmethod
    def _console_colours(cls, value: dict[str, str]) -> dict[str, str]:
        for key, colour in value.items():
            if key in CONSOLE_VARIABLES:
                try:
                    _colour(colour)
                except ValueError as exc:
                    raise ValueError(f"{key}: {exc}") from None
        return value

    def to_theme(self, name: str) -> Theme:
        """The Textual theme, named `self.name` or else `name`."""
        values = self.model_dump(exclude={"name", "variables"}, exclude_none=True)
        return Theme(name=self.name or name, variables=dict(self.variables), **values)


def _parse(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return json.loads(text)
    return tomllib.loads(text)


def load_theme_file(path: Path) -> Theme:
    """Read one theme file.

    Args:
        path: a `.toml` or `.json` file.

    Returns:
        The theme, named after the file's stem unless the file names it.

    Raises:
        ThemeFileError: the file cannot be read, is not valid TOML/JSON, or a field is unknown or not a colour.
    """
    try:
        data = _parse(path)
    except OSError as exc:
        raise ThemeFileError(f"The theme file {path} cannot be read: {exc.strerror or exc}.", path=path) from exc
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ThemeFileError(
            f"The theme file {path} is not valid {path.suffix[1:].upper()}: {exc}.", path=path
        ) from exc
    try:
        model = ThemeFile.model_validate(data)
    except ValidationError as exc:
        first = first_violation(exc)
        field = first.field or "the file"
        advice = {
            "missing": f"Add {field} (themes/README.md lists the fields).",
            "extra_forbidden": "Remove it, or check its spelling against themes/README.md.",
        }.get(first.kind, "Fix the value.")
        raise ThemeFileError(
            f"The theme file {path} is invalid at {field}: {first.message}. {advice}", path=path
        ) from None
    return model.to_theme(path.stem)


def load_themes(directories: Iterable[Path]) -> tuple[list[Theme], list[ThemeFileError]]:
    """Every theme file (`*.toml`, `*.json`) of the directories; a later file with the same name wins.

    Returns:
        The themes, and the errors of files that could not be loaded (the console shows them and carries on).
    """
    themes: dict[str, Theme] = {}
    errors: list[ThemeFileError] = []
    for directory in directories:
        if not directory.is_dir():
            continue
        for path in sorted([*directory.glob("*.toml"), *directory.glob("*.json")]):
            try:
                theme = load_theme_file(path)
            except ThemeFileError as exc:
                logger.debug("%s", exc.message)  # the caller shows it (the console as a notification)
                errors.append(exc)
                continue
            themes[theme.name] = theme
    return list(themes.values()), errors


def console_variable_defaults(system: Mapping[str, str]) -> dict[str, str]:
    """Values of `CONSOLE_VARIABLES` derived from a theme's colour system (`Theme.to_color_system().generate()`)."""
    return {name: system[source] for name, source in CONSOLE_VARIABLES.items() if source in system}
