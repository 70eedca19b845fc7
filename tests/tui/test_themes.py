"""Themes are data files, checked when loaded; the chosen one is remembered in the config home."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from rich.style import Style

from qiip_core.client import ConsoleConfig
from qiip_tui import QiipConsole, ThemeFileError, load_theme_file, load_themes
from qiip_tui._render import Palette
from qiip_tui._state import ConsoleState, load_state, save_state
from qiip_tui._themes import CONSOLE_VARIABLES, THEME_DIRS, console_variable_defaults
from qiip_tui.screens import ConnectionScreen
from tests.support.daemon import free_port
from tests.tui.conftest import wait_for

SHIPPED = Path(__file__).resolve().parents[2] / "themes"


def test_the_shipped_themes_load_and_set_every_console_colour() -> None:
    themes, errors = load_themes([SHIPPED])
    assert errors == []
    assert {t.name for t in themes} >= {"dark", "light", "high-contrast"}
    for theme in themes:
        assert set(CONSOLE_VARIABLES) <= set(theme.variables), theme.name
    assert SHIPPED in [path.resolve() for path in THEME_DIRS]


def test_the_wheel_ships_the_themes_where_an_installed_console_looks() -> None:
    pyproject = tomllib.loads((SHIPPED.parent / "pyproject.toml").read_text())
    force_include = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    installed = Path(__file__).resolve().parents[2] / force_include["themes"]
    assert installed == THEME_DIRS[0].resolve()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("primary = ", "is not valid TOML"),
        ('primary = "#123456"\nsparkle = true\n', "invalid at sparkle: Extra inputs are not permitted. Remove it"),
        ('primary = "bluish"\n', "invalid at primary: 'bluish' is not a colour"),
        ("dark = true\n", "invalid at primary: Field required. Add primary"),
        ('primary = "#fff"\n[variables]\nstatus-healthy = "nope"\n', "status-healthy: 'nope' is not a colour"),
        ('name = "Bad Name"\nprimary = "#fff"\n', "invalid at name: String should match pattern"),
    ],
)
def test_a_bad_theme_file_says_which_file_and_which_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "broken.toml"
    path.write_text(text)
    with pytest.raises(ThemeFileError) as caught:
        load_theme_file(path)
    assert str(path) in caught.value.message and message in caught.value.message
    assert caught.value.path == path


def test_json_themes_work_and_a_bad_file_does_not_stop_the_others(tmp_path: Path) -> None:
    (tmp_path / "ocean.json").write_text(json.dumps({"primary": "#0077be", "variables": {"status-healthy": "#00ff00"}}))
    (tmp_path / "broken.toml").write_text("primary = 1")
    themes, errors = load_themes([tmp_path])
    assert [t.name for t in themes] == ["ocean"] and themes[0].variables["status-healthy"] == "#00ff00"
    assert len(errors) == 1 and "broken.toml" in errors[0].message


def test_status_colours_come_from_the_theme_variables() -> None:
    dark = load_theme_file(SHIPPED / "dark.toml")
    variables = {**console_variable_defaults(dark.to_color_system().generate()), **dark.variables}
    palette = Palette.from_variables(variables)
    assert palette.status("healthy") == Style(color="#57ab5a")
    assert palette.status("relaunch_failed") == Style(color="#ff7b72")
    assert palette.status("no-such-status") == Style()


def test_the_state_file_is_written_atomically_and_a_broken_one_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "qiip" / "console-state.json"
    assert load_state(path) == ConsoleState()
    save_state(path, ConsoleState(theme="light"))
    assert load_state(path).theme == "light" and list(path.parent.iterdir()) == [path]
    path.write_text("{not json")
    assert load_state(path) == ConsoleState()


async def test_a_theme_chosen_in_the_palette_is_remembered(config_home: Path) -> None:
    config = ConsoleConfig(url=f"http://127.0.0.1:{free_port()}")
    app = QiipConsole(config, retry_delays_s=(30.0,))
    async with app.run_test(size=(100, 30)) as pilot:
        assert app.theme == "dark"
        # No daemon answers: the console settles on its connection screen, and the palette opens over that (a
        # palette opened before would stay behind on the fleet screen).
        await wait_for(pilot, lambda: isinstance(app.screen, ConnectionScreen), what="the connection screen")
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"Theme: high", "enter")
        await wait_for(pilot, lambda: app.theme == "high-contrast", what="the theme to change")
        state = config_home / "qiip" / "console-state.json"
        await wait_for(pilot, lambda: state.exists(), what="the state file")
    assert json.loads(state.read_text()) == {"theme": "high-contrast"}
    again = QiipConsole(config, retry_delays_s=(30.0,))
    async with again.run_test(size=(100, 30)):
        assert again.theme == "high-contrast"


async def test_many_broken_theme_files_make_one_notification(tmp_path: Path, config_home: Path) -> None:
    for name in ("a", "b", "c", "d"):
        (tmp_path / f"{name}.toml").write_text("primary = 1")
    config = ConsoleConfig(url=f"http://127.0.0.1:{free_port()}")
    app = QiipConsole(config, retry_delays_s=(30.0,), theme_dirs=[SHIPPED, tmp_path])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        notes = [n for n in app._notifications if n.title.startswith("Theme")]
        assert len(notes) == 1 and notes[0].message.startswith("4 theme files skipped: a.toml, b.toml, c.toml, d.toml.")
