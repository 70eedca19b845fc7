"""The log view: bounded, coloured by level, paused and resumed, searched, fed by an async iterator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from textual.app import App, ComposeResult
from textual.widgets import RichLog

from qiip_tui import LogRecord, QiipConsole
from qiip_tui._themes import console_variable_defaults
from qiip_tui.screens import NOT_AVAILABLE, LogsScreen
from qiip_tui.widgets import LogView
from tests.tui.conftest import screen_of, wait_for
from tests.tui.fakes import FakeClient
from tests.tui.samples import sample_fleet


class Host(App[None]):
    def get_theme_variable_defaults(self) -> dict[str, str]:
        return console_variable_defaults(self.current_theme.to_color_system().generate())

    def compose(self) -> ComposeResult:
        yield LogView(max_lines=50, id="log")


async def records(n: int, gate: asyncio.Event | None = None) -> AsyncIterator[LogRecord]:
    for i in range(n):
        if gate is not None and i == n // 2:
            await gate.wait()
        yield LogRecord(level=("info", "warning", "error")[i % 3], message=f"step {i}", source="gpu01")


async def test_a_source_fills_a_bounded_log_that_can_pause_and_search() -> None:
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(LogView)
        log = view.query_one(RichLog)
        view.follow_source(records(120))
        await wait_for(pilot, lambda: len(view.records) == 50 and view.records[-1].message == "step 119")
        assert view.records[0].message == "step 70", "only the last max_lines records are kept"
        assert len(log.lines) == 50

        log.focus()
        await pilot.press("space")
        assert not view.following and not log.auto_scroll
        await pilot.press("space")
        assert view.following and log.auto_scroll

        await pilot.press("slash", *"step 11")
        await wait_for(pilot, lambda: view.search_text == "step 11")
        assert len(log.lines) == 10 and all("step 11" in line.text for line in log.lines)
        await pilot.press("escape")
        assert view.search_text == "" and len(log.lines) == 50


async def test_levels_have_their_theme_colour() -> None:
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(LogView)
        view.write(LogRecord(level="error", message="disk full"))
        view.write(LogRecord(level="info", message="ok"))
        await pilot.pause()
        error, info = view.query_one(RichLog).lines[-2:]
        error_style = next(s.style for s in error if s.text.startswith("ERROR"))
        info_style = next(s.style for s in info if s.text.startswith("INFO"))
        assert error_style is not None and info_style is not None and error_style.color != info_style.color


async def test_the_provisioning_screen_says_when_the_daemon_does_not_provision() -> None:
    app = QiipConsole(client=FakeClient(sample_fleet()), retry_delays_s=(30.0,))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("l")
        screen = await screen_of(pilot, LogsScreen)
        assert str(screen.query_one("#logs-banner").render()) == NOT_AVAILABLE
        assert not screen.query_one(LogView).records


async def test_a_search_matches_the_step_too() -> None:
    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.query_one(LogView)
        view.write(LogRecord(level="info", message="step nvidia_driver", source="nvidia_driver"))
        view.write(LogRecord(level="info", message="installing", source="nvidia_driver"))
        view.write(LogRecord(level="info", message="installing", source="vllm_install"))
        view.query_one(RichLog).focus()
        await pilot.press("slash", *"nvidia")
        await wait_for(pilot, lambda: view.search_text == "nvidia")
        assert len(view.query_one(RichLog).lines) == 2


async def test_a_failed_steps_label_takes_the_error_colour() -> None:
    app = Host()
    async with app.run_test() as pilot:
        await pilot.pause()
        view = app.query_one(LogView)
        view.write(LogRecord(level="info", message="installing", at=None, source="nvidia_driver"))
        view.write(
            LogRecord(level="error", message="driver 550 installed, 580 pinned", at=None, source="nvidia_driver")
        )
        # Later lines of the failed step keep its label in the error colour; other steps' labels do not.
        later = view._render_record(LogRecord(level="info", message="cleanup", at=None, source="nvidia_driver"))
        other = view._render_record(LogRecord(level="info", message="ok", at=None, source="cuda_toolkit"))
        label = len("INFO    ")

        def label_style(text: object) -> object:
            return next(span.style for span in text.spans if span.start == label)  # type: ignore[attr-defined]

        assert label_style(later) != label_style(other)
        view.clear()
        again = view._render_record(LogRecord(level="info", message="retry", at=None, source="nvidia_driver"))
        assert label_style(again) == label_style(other)
