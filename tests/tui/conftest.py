"""Fixtures of the console's tests: a private config home, frozen cursors, and a real daemon with real nodes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pydantic import SecretStr
from textual import events
from textual.css.stylesheet import Stylesheet
from textual.pilot import Pilot
from textual.screen import Screen
from textual.widgets import Input

from qiip_core.client import ConsoleConfig
from qiip_tui import QiipConsole
from tests.support.daemon import WAIT_S, Daemon, llama_daemon_with
from tests.support.fault_backend import FaultBackend

ADMIN = ConsoleConfig(url="http://127.0.0.1:1", username="admin", password="test-password", source="the test")
"""The credentials `tests.support.daemon.Daemon` gives its daemons (the URL is replaced per daemon)."""


@pytest.fixture(autouse=True)
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private `$XDG_CONFIG_HOME`, so no test reads or writes the user's console state or themes."""
    home = tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    for name in ("QIIP_URL", "QIIP_ADMIN__USERNAME", "QIIP_ADMIN__PASSWORD", "QIIP_TOKEN", "QIIP_CONSOLE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    return home


@pytest.fixture(autouse=True)
def steady_cursor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs show their cursor without blinking, so a screenshot does not depend on when it is taken."""
    monkeypatch.setattr(Input, "_toggle_cursor", lambda self: None)


@pytest.fixture(autouse=True)
def lasting_notifications(monkeypatch: pytest.MonkeyPatch) -> None:
    """Notifications stay until the test looks: on a busy machine a test may reach its check after 5 s."""
    monkeypatch.setattr(QiipConsole, "NOTIFICATION_TIMEOUT", 3600.0)


_PARSED_CSS: dict[tuple[Any, ...], Any] = {}
"""Textual's parsed stylesheets, shared by every app of a test process (`shared_css`)."""


@pytest.fixture(autouse=True, scope="session")
def shared_css() -> Iterator[None]:
    """Each app parses the same stylesheets (every widget's default CSS, the console's, each theme's variables)
    again, a tenth of a picture's CPU; the tests' apps share one parse of each, keyed as Textual keys its own cache
    (`Stylesheet._parse_rules`, textual 8.2) and by the variables they were parsed with. The rules are only read
    after parsing (`Stylesheet.parse` copies them into a list of its own)."""
    original = Stylesheet._parse_rules

    def parse_once(self: Stylesheet, css: str, read_from: Any, *args: Any, **kwargs: Any) -> Any:
        key = (css, read_from, args, tuple(sorted(kwargs.items())), tuple(sorted(self._variables.items())))
        rules = _PARSED_CSS.get(key)
        if rules is None:
            rules = _PARSED_CSS[key] = original(self, css, read_from, *args, **kwargs)
        return rules

    Stylesheet._parse_rules = parse_once  # type: ignore[method-assign]
    try:
        yield
    finally:
        Stylesheet._parse_rules = original  # type: ignore[method-assign]


def config_for(daemon: Daemon, *, password: str = "test-password") -> ConsoleConfig:
    """The console's config for a test daemon."""
    return ADMIN.model_copy(update={"url": daemon.url, "password": SecretStr(password)})


async def wait_for(
    pilot: Pilot[Any], predicate: Callable[[], object], timeout_s: float = WAIT_S, what: str = ""
) -> None:
    """Let the app run until `predicate()` is true.

    Raises:
        TimeoutError: it stayed false for `timeout_s` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what or predicate}")
        await pilot.pause(0.05)


T = TypeVar("T")


async def in_thread(function: Callable[[], T]) -> T:
    """Run a blocking test helper without blocking the app's event loop."""
    return await asyncio.to_thread(function)


@pytest.fixture(scope="session")
def slow_backend() -> Iterator[FaultBackend]:
    """A scripted node serving `slow-model`; tests push the stream they need."""
    with FaultBackend(model="slow-model") as backend:
        yield backend


@pytest.fixture(scope="session")
def console_daemon(
    tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path, llama_server_binary: Path, slow_backend: FaultBackend
) -> Iterator[Daemon]:
    """A daemon with two local llama.cpp nodes on the tiny model (`chat-a`, `chat-b`) and the scripted `slow`."""
    local = [
        {"id": "chat-a", "gguf": str(tiny_gguf), "model": "tiny-chat", "slots": 2, "threads": 1},
        {"id": "chat-b", "gguf": str(tiny_gguf), "model": "tiny-chat", "slots": 2, "threads": 1},
    ]
    with llama_daemon_with(tmp_path_factory.mktemp("console-daemon"), llama_server_binary, local) as daemon:
        daemon.add_node("slow", slow_backend.url, "slow-model")
        yield daemon


ScreenT = TypeVar("ScreenT", bound=Screen[Any])


async def screen_of(pilot: Pilot[Any], kind: type[ScreenT], timeout_s: float = WAIT_S) -> ScreenT:
    """Wait until the app shows a mounted screen of type `kind`, and return it."""
    app = pilot.app
    await wait_for(pilot, lambda: isinstance(app.screen, kind) and app.screen.is_mounted, timeout_s, kind.__name__)
    await pilot.pause()
    screen = app.screen
    assert isinstance(screen, kind)
    return screen


_CHARACTERS = {"backspace": "\x7f", "space": " ", "enter": "\r", "tab": "\t", "escape": "\x1b"}


async def burst(pilot: Pilot[Any], *keys: str) -> None:
    """Send `keys` the way one read from the terminal delivers them: all at once, with no pause between them for
    the app to act on the first before the next arrives (`Pilot.press` waits after each). Then let the app finish.
    """
    app = pilot.app
    driver = app._driver
    assert driver is not None
    for key in keys:
        character = _CHARACTERS.get(key, key if len(key) == 1 else None)
        event = events.Key(key, character)
        event.set_sender(app)
        driver.send_message(event)
    await pilot.pause()
    await pilot.pause()
