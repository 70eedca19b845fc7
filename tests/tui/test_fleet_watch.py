"""Watching a fleet: rates, problems first, each model's health, errors with their age, stale data, themes.

Against a real daemon with scripted nodes: `good` and `flaky` serve `m1`, `dead` serves `m2` from a port where
nothing listens, so `m2` has no healthy node and its clients get 503.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from rich.text import Text
from textual.coordinate import Coordinate
from textual.widgets import Static

from qiip_tui import QiipConsole
from qiip_tui._render import Palette
from qiip_tui.screens import NodeScreen
from qiip_tui.widgets import FleetSummary, FleetTable
from tests.support.daemon import Daemon, free_port
from tests.support.fault_backend import FaultBackend, Status
from tests.tui.conftest import config_for, in_thread, screen_of, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[Daemon, FaultBackend]]:
    """A daemon with `good` and `flaky` serving `m1` and `dead` serving `m2`; yields it and flaky's backend."""
    with FaultBackend(model="m1") as good, FaultBackend(model="m1") as flaky, Daemon(tmp_path / "state") as daemon:
        daemon.add_node("good", good.url, "m1")
        daemon.add_node("flaky", flaky.url, "m1")
        daemon.add_node("dead", f"http://127.0.0.1:{free_port()}", "m2", wait=False)
        daemon.wait_status("dead", "unhealthy", timeout_s=30)
        yield daemon, flaky


def _rows(table: FleetTable) -> list[str]:
    return [str(table.get_cell_at(Coordinate(row, 0))) for row in range(table.row_count)]


def _cell(table: FleetTable, node_id: str, column: str) -> Text:
    value = table.get_cell(node_id, column)
    assert isinstance(value, Text)
    return value


def _summary(app: QiipConsole) -> str:
    return str(app.screen.query_one(FleetSummary).render())


def _traffic(daemon: Daemon) -> None:
    for _ in range(12):
        httpx.post(daemon.url + "/v1/chat/completions", json={"model": "m1", "messages": []}, timeout=30)
    for _ in range(3):
        answer = httpx.post(daemon.url + "/v1/chat/completions", json={"model": "m2", "messages": []}, timeout=30)
        assert answer.status_code == 503


def _keep_busy(daemon: Daemon, stop: threading.Event) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            client.post(daemon.url + "/v1/chat/completions", json={"model": "m1", "messages": []})
            stop.wait(0.05)


async def test_rates_problems_first_model_health_and_errors_with_their_age(
    watched: tuple[Daemon, FaultBackend],
) -> None:
    daemon, flaky = watched
    # Two failures, then answers: flaky fails over to good, and its breaker stays closed.
    flaky.push(Status(500), Status(500))
    app = QiipConsole(config_for(daemon), metrics_interval_s=0.3)
    async with app.run_test(size=(160, 40)) as pilot:
        table = app.screen.query_one(FleetTable)
        await wait_for(pilot, lambda: len(_rows(table)) == 3, what="the three nodes")
        assert _rows(table)[0] == "dead", "an unhealthy node comes first"
        # Every failed probe is a new error: its age is `now` or a few seconds.
        assert _cell(table, "dead", "error").plain.split(" · ")[1].startswith("GET /health")

        await in_thread(lambda: _traffic(daemon))
        # A rate is of the last poll's interval: keep m1 busy until the table shows one.
        busy = threading.Event()
        feeder = threading.Thread(target=_keep_busy, args=(daemon, busy))
        feeder.start()
        try:
            await wait_for(
                pilot,
                lambda: _cell(table, "good", "rps").plain not in ("—", "0") and "m2 0/1 healthy · " in _summary(app),
                what="the rates",
            )
        finally:
            busy.set()
            await in_thread(feeder.join)
        # m2 has no healthy node and every request failed: it leads the models line, in the error colour.
        models_line = _summary(app).splitlines()[1]
        assert models_line.startswith("m2 0/1 healthy · 100% errors"), models_line
        await wait_for(pilot, lambda: app.fleet.rates.nodes.get("flaky") is not None, what="flaky's rates")
        flaky_rates = app.fleet.rates.nodes["flaky"]
        assert flaky_rates.error_ratio, "failures stay in the error ratio for a minute"
        assert any(sample.retries_per_s > 0 for sample in app.fleet.rates.history["flaky"])
        assert _cell(table, "flaky", "errors").plain.endswith("%")
        # No slot count: the column shows the requests in flight, none once the feeder stopped (a poll taken while it
        # ran may still show one).
        await wait_for(pilot, lambda: _cell(table, "flaky", "slots").plain == "0", what="flaky's in-flight count at 0")

        # Problems only: the dead node, and flaky, which failed within the last minute.
        await pilot.press("e")
        assert _rows(table) == ["dead", "flaky"]
        assert "2/3 shown · problems only" in _summary(app)
        await pilot.press("e")
        assert len(_rows(table)) == 3

        await pilot.press("slash", *"no-such-node", "enter")
        empty = app.screen.query_one("#fleet-empty")
        assert empty.display and "No node matches 'no-such-node' (3 nodes in the fleet)" in str(empty.render())
        await pilot.press("escape")
        assert not empty.display

        # flaky answers again: its last error stays, with its age, dimmed once it is healthy with its breaker closed.
        error = _cell(table, "flaky", "error")
        assert "ago · " in error.plain and "500" in error.plain
        assert any(span.style == "dim" for span in error.spans)
        assert not any(span.style == "dim" for span in _cell(table, "dead", "error").spans)


async def test_a_theme_switch_recolours_the_status_and_breaker_cells(watched: tuple[Daemon, FaultBackend]) -> None:
    daemon, _ = watched
    app = QiipConsole(config_for(daemon))
    async with app.run_test(size=(160, 40)) as pilot:
        table = app.screen.query_one(FleetTable)
        await wait_for(pilot, lambda: len(_rows(table)) == 3, what="the nodes")
        for theme in ("light", "dark"):
            app.set_theme(theme)
            await pilot.pause()
            palette = Palette.from_variables(app.theme_variables)
            assert _cell(table, "dead", "status").style == palette.status("unhealthy")
            assert _cell(table, "good", "status").style == palette.status("healthy")
            assert _cell(table, "good", "breaker").style == palette.style("breaker-closed")


async def test_stale_data_is_dimmed_and_dated_and_refreshed_after_reconnecting(
    watched: tuple[Daemon, FaultBackend],
) -> None:
    daemon, _ = watched
    app = QiipConsole(config_for(daemon), retry_delays_s=(0.2,), metrics_interval_s=0.3)
    async with app.run_test(size=(160, 40)) as pilot:
        table = app.screen.query_one(FleetTable)
        await wait_for(pilot, lambda: len(_rows(table)) == 3 and app.last_update is not None, what="the nodes")
        assert "● live" in _summary(app) and not table.has_class("-stale")

        await in_thread(daemon.stop)
        await wait_for(pilot, lambda: not app.connection.connected, what="the outage")
        app.switch_mode("fleet")
        await wait_for(pilot, lambda: "○ not connected · data from" in _summary(app), what="the stale summary")
        table = app.screen.query_one(FleetTable)
        assert table.has_class("-stale")
        assert _cell(table, "good", "status").plain == "healthy", "the last known state, dimmed"

        # While the daemon is down, a node is removed; after reconnecting the table no longer shows it.
        daemon.remove_node("dead")
        starter = threading.Thread(target=daemon.start)
        starter.start()
        await wait_for(pilot, lambda: not starter.is_alive(), timeout_s=150, what="the daemon to start")
        await wait_for(pilot, lambda: app.connection.connected, what="the reconnection")
        app.switch_mode("fleet")
        table = app.screen.query_one(FleetTable)
        await wait_for(pilot, lambda: "dead" not in _rows(table), what="the refreshed fleet")
        assert not table.has_class("-stale") and "● live" in _summary(app)


async def test_the_node_screen_shows_traffic_and_dated_errors_that_fade_once_it_recovers(
    watched: tuple[Daemon, FaultBackend],
) -> None:
    daemon, flaky = watched
    flaky.push(Status(500))
    app = QiipConsole(config_for(daemon), metrics_interval_s=0.3, node_poll_s=0.3)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: "flaky" in app.fleet.nodes, what="the fleet")
        await in_thread(lambda: _traffic(daemon))
        await wait_for(pilot, lambda: bool(app.fleet.nodes["flaky"].last_error), what="flaky's error")
        app.open_node("flaky")
        screen = await screen_of(pilot, NodeScreen)
        traffic = screen.query_one("#traffic-now", Static)
        await wait_for(pilot, lambda: "Errors " in str(traffic.render()) and "%" in str(traffic.render()))
        errors = screen.query_one("#errors", Static)
        await wait_for(pilot, lambda: "500" in str(errors.render()), what="the error")
        text = str(errors.render())
        # `12:03:04 (now) …500…`, dimmed: flaky answered the next requests, healthy with its breaker closed.
        assert text[2] == ":" and text[5] == ":" and " (" in text[:12]
        assert "The node is healthy again: these errors are past." in text
