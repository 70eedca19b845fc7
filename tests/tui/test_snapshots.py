"""What every screen looks like, at 80×24 and 160×48.

The data comes from `FakeClient`'s canned fleet, the clock is frozen and cursors do not blink, so each picture
is the same on every run. Update them with `uv run pytest tests/tui --snapshot-update` after a deliberate change.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, ProgressBar
from textual.widgets._progress_bar import Bar

from qiip_core.client import ClientError, DaemonUnreachable, NodeInfo, Unauthorized
from qiip_tui import QiipConsole
from qiip_tui._chat import TurnState
from qiip_tui.screens import (
    ChatScreen,
    CommandLine,
    ConfirmModal,
    ConnectionScreen,
    DeploymentsScreen,
    DescribeScreen,
    DownloadModal,
    FleetScreen,
    HelpScreen,
    LogsScreen,
    ModelsScreen,
    NodeScreen,
    RecommendationsScreen,
    SizingScreen,
)
from qiip_tui.screens._setup import SetupModal
from qiip_tui.widgets import LogView
from tests.tui.conftest import screen_of, wait_for
from tests.tui.fakes import (
    FakeClient,
    FakeDeploymentsClient,
    FakeLogsClient,
    FakeModelsClient,
    FakeProvisioningClient,
    FakeQuadsClient,
    FakeRecommendationsClient,
)
from tests.tui.samples import SAMPLE_METRICS, ollama_node, sample_fleet

SIZES = [pytest.param((80, 24), id="80x24"), pytest.param((160, 48), id="160x48")]

Snap = Callable[..., bool]
Steps = Callable[[Pilot[Any]], Awaitable[None]]


NOW = datetime(2026, 11, 29, 12, 5, tzinfo=UTC)
"""The snapshots' time of day: gpu04's error was seen three minutes before."""


def console(client: FakeClient | None = None) -> QiipConsole:
    client = client or FakeClient(sample_fleet(), metrics=SAMPLE_METRICS)
    ticks = itertools.count(1000.0, 5.0)
    # Polls that would add readings after the picture is due never come (an hour apart); each reading of the
    # clock is five seconds after the last, so two polls give the sample's rates.
    app = QiipConsole(
        client=client,
        clock=lambda: next(ticks),
        wall_clock=lambda: NOW,
        metrics_interval_s=3600,
        node_poll_s=3600,
    )
    # No animation: an indeterminate progress bar or a fading style is drawn in its final state, not in whichever
    # frame the picture happens to catch (a busy machine catches another one).
    app.animation_level = "none"
    return app


def downloads_filled(screen: ModelsScreen) -> bool:
    """Both sample downloads are shown and the running one's bar holds its bytes: a row is filled after its first
    refresh, and a picture taken before that (a busy machine) would catch the bar empty or part-drawn."""
    bars = [row.query_one(ProgressBar) for row in screen.query(".download")]
    return len(bars) == 2 and [bar.progress for bar in bars] == [2_000_000_000, 0] and all(map(drawn_for_width, bars))


def drawn_for_width(bar: ProgressBar) -> bool:
    """The bar's fill is rounded for the width it has now (Textual rounds it to half cells of the width at the time
    the value is set; the screen sets it again at each poll). A bar without a total has no fill to round."""
    if bar.percentage is None:
        return True
    inner = bar.query_one("#bar", Bar)
    halves = inner.size.width * 2
    return halves > 0 and inner.percentage == int(bar.percentage * halves) / halves


async def fleet_ready(pilot: Pilot[Any]) -> None:
    app = pilot.app
    assert isinstance(app, QiipConsole)
    await screen_of(pilot, FleetScreen)
    await wait_for(pilot, lambda: len(app.fleet.nodes) == 8 and bool(app.fleet.ttft_p50_s), what="the fleet")
    # The second poll, which gives the rates.
    app.feed.poll_metrics()
    await wait_for(pilot, lambda: app.fleet.requests_per_s is not None, what="the rates")
    await pilot.pause()


def then(*steps: Steps) -> Steps:
    async def run(pilot: Pilot[Any]) -> None:
        await fleet_ready(pilot)
        for step in steps:
            await step(pilot)
        await pilot.pause()

    return run


def keys(*pressed: str) -> Steps:
    async def press(pilot: Pilot[Any]) -> None:
        await pilot.press(*pressed)

    return press


def shows(kind: type[Any]) -> Steps:
    async def wait(pilot: Pilot[Any]) -> None:
        await screen_of(pilot, kind)

    return wait


@pytest.mark.parametrize("size", SIZES)
def test_fleet(snap_compare: Snap, size: tuple[int, int]) -> None:
    assert snap_compare(console(), terminal_size=size, run_before=then())


@pytest.mark.parametrize("size", SIZES)
def test_fleet_filtered_and_sorted(snap_compare: Snap, size: tuple[int, int]) -> None:
    steps = then(keys("s", "S", "slash", *"llama", "enter"))
    assert snap_compare(console(), terminal_size=size, run_before=steps)


@pytest.mark.parametrize("size", SIZES)
def test_fleet_problems_only(snap_compare: Snap, size: tuple[int, int]) -> None:
    assert snap_compare(console(), terminal_size=size, run_before=then(keys("e")))


@pytest.mark.parametrize("size", SIZES)
def test_fleet_filter_matching_nothing(snap_compare: Snap, size: tuple[int, int]) -> None:
    steps = then(keys("slash", *"nothing-like-this", "enter"))
    assert snap_compare(console(), terminal_size=size, run_before=steps)


@pytest.mark.parametrize("size", SIZES)
def test_fleet_scrolled_sideways(snap_compare: Snap, size: tuple[int, int]) -> None:
    assert snap_compare(console(), terminal_size=size, run_before=then(keys("right", "right", "right")))


@pytest.mark.parametrize("size", SIZES)
def test_fleet_stale_after_a_disconnect(snap_compare: Snap, size: tuple[int, int]) -> None:
    async def disconnect(pilot: Pilot[Any]) -> None:
        app = pilot.app
        assert isinstance(app, QiipConsole)
        app.connection.retry_delays_s = (60.0,)
        client = app.client
        assert isinstance(client, FakeClient)
        client.fail = DaemonUnreachable("The daemon at http://127.0.0.1:8080 does not answer.")
        client.end_events()
        await screen_of(pilot, ConnectionScreen)
        app.switch_mode("fleet")
        await screen_of(pilot, FleetScreen)

    assert snap_compare(console(), terminal_size=size, run_before=then(disconnect))


@pytest.mark.parametrize("size", SIZES)
def test_node(snap_compare: Snap, size: tuple[int, int]) -> None:
    steps = then(keys("slash", *"gpu02", "enter", "enter"), shows(NodeScreen))
    assert snap_compare(console(), terminal_size=size, run_before=steps)


@pytest.mark.parametrize("size", SIZES)
def test_an_ollama_node_with_its_model_loaded(snap_compare: Snap, size: tuple[int, int]) -> None:
    # In the place of one vLLM node: the pictures' fleet has eight nodes.
    fleet = [ollama_node() if node.id == "vllm02" else node for node in sample_fleet()]
    steps = then(keys("slash", *"lab-ollama", "enter", "enter"), shows(NodeScreen))
    assert snap_compare(console(FakeClient(fleet, metrics=SAMPLE_METRICS)), terminal_size=size, run_before=steps)


@pytest.mark.parametrize("size", SIZES)
def test_node_with_an_error(snap_compare: Snap, size: tuple[int, int]) -> None:
    steps = then(keys("slash", *"gpu04", "enter", "enter"), shows(NodeScreen))
    assert snap_compare(console(), terminal_size=size, run_before=steps)


@pytest.mark.parametrize("size", SIZES)
def test_describe(snap_compare: Snap, size: tuple[int, int]) -> None:
    steps = then(keys("slash", *"gpu04", "enter", "d"), shows(DescribeScreen))
    assert snap_compare(console(), terminal_size=size, run_before=steps)


@pytest.mark.parametrize("size", SIZES)
def test_fleet_marked_and_one_confirmation_for_all(snap_compare: Snap, size: tuple[int, int]) -> None:
    steps = then(keys("space", "space", "down", "space"), keys("D"), shows(ConfirmModal))
    assert snap_compare(console(), terminal_size=size, run_before=steps)


@pytest.mark.parametrize("size", SIZES)
def test_confirm_drain(snap_compare: Snap, size: tuple[int, int]) -> None:
    steps = then(keys("slash", *"gpu02", "enter", "enter"), shows(NodeScreen), keys("D"), shows(ConfirmModal))
    assert snap_compare(console(), terminal_size=size, run_before=steps)


@pytest.mark.parametrize("size", SIZES)
def test_sizing_editor_with_a_violation(snap_compare: Snap, size: tuple[int, int]) -> None:
    async def type_context(pilot: Pilot[Any]) -> None:
        field = pilot.app.screen.query_one("#context_per_slot", Input)
        await pilot.click("#context_per_slot")
        await pilot.press("end", *["backspace"] * len(field.value), *"3000")

    steps = then(keys("slash", *"gpu02", "enter", "r"), shows(SizingScreen), type_context)
    assert snap_compare(console(), terminal_size=size, run_before=steps)


@pytest.mark.parametrize("size", SIZES)
def test_chat(snap_compare: Snap, size: tuple[int, int]) -> None:
    async def chat(pilot: Pilot[Any]) -> None:
        screen = await screen_of(pilot, ChatScreen)
        await wait_for(pilot, lambda: "models available" in str(screen.query_one("#chat-status").render()))
        await pilot.press(*"How is the fleet?", "enter")
        await wait_for(pilot, lambda: bool(screen.conversation.turns))
        await wait_for(pilot, lambda: screen.conversation.turns[-1].state is TurnState.DONE)

    assert snap_compare(console(), terminal_size=size, run_before=then(keys("c"), chat))


@pytest.mark.parametrize("size", SIZES)
def test_logs(snap_compare: Snap, size: tuple[int, int]) -> None:
    assert snap_compare(console(), terminal_size=size, run_before=then(keys("l"), shows(LogsScreen)))


@pytest.mark.parametrize("size", SIZES)
def test_logs_timeline(snap_compare: Snap, size: tuple[int, int]) -> None:
    async def loaded(pilot: Pilot[Any]) -> None:
        screen = await screen_of(pilot, LogsScreen)
        view = screen.query_one("#timeline-view", LogView)
        await wait_for(pilot, lambda: len(view.records) == 10, what="the timeline")
        await pilot.pause()

    client = FakeLogsClient(sample_fleet(), metrics=SAMPLE_METRICS)
    assert snap_compare(console(client), terminal_size=size, run_before=then(keys("l"), loaded))


@pytest.mark.parametrize("size", SIZES)
def test_logs_timeline_search(snap_compare: Snap, size: tuple[int, int]) -> None:
    async def searched(pilot: Pilot[Any]) -> None:
        screen = await screen_of(pilot, LogsScreen)
        view = screen.query_one("#timeline-view", LogView)
        await wait_for(pilot, lambda: len(view.records) == 10, what="the timeline")
        view.query_one("#log-lines").focus()
        await pilot.press("slash", *"gpu02")
        await wait_for(pilot, lambda: view.search_text == "gpu02")

    client = FakeLogsClient(sample_fleet(), metrics=SAMPLE_METRICS)
    assert snap_compare(console(client), terminal_size=size, run_before=then(keys("l"), searched))


@pytest.mark.parametrize("size", SIZES)
def test_logs_engine_log(snap_compare: Snap, size: tuple[int, int]) -> None:
    async def followed(pilot: Pilot[Any]) -> None:
        screen = await screen_of(pilot, LogsScreen)
        await pilot.press("2")
        screen.query_one("#engine-nodes").focus()
        await pilot.press("enter")
        view = screen.query_one("#engine-log", LogView)
        await wait_for(pilot, lambda: len(view.records) == 7, what="the engine log")
        await pilot.pause()

    client = FakeLogsClient(sample_fleet(), metrics=SAMPLE_METRICS)
    assert snap_compare(console(client), terminal_size=size, run_before=then(keys("l"), followed))


@pytest.mark.parametrize("size", SIZES)
def test_provisioning(snap_compare: Snap, size: tuple[int, int]) -> None:
    async def loaded(pilot: Pilot[Any]) -> None:
        screen = await screen_of(pilot, LogsScreen)
        view = screen.query_one("#log-view", LogView)
        await wait_for(pilot, lambda: len(view.records) == 8, what="the log")
        await pilot.pause()

    client = FakeProvisioningClient(sample_fleet(), metrics=SAMPLE_METRICS)
    assert snap_compare(console(client), terminal_size=size, run_before=then(keys("l", "3"), loaded))


@pytest.mark.parametrize("size", SIZES)
def test_provisioning_log_search(snap_compare: Snap, size: tuple[int, int]) -> None:
    async def searched(pilot: Pilot[Any]) -> None:
        screen = await screen_of(pilot, LogsScreen)
        view = screen.query_one("#log-view", LogView)
        await wait_for(pilot, lambda: len(view.records) == 8, what="the log")
        view.query_one("#log-lines").focus()
        await pilot.press("slash", *"install")
        await wait_for(pilot, lambda: view.search_text == "install")

    client = FakeProvisioningClient(sample_fleet(), metrics=SAMPLE_METRICS)
    assert snap_compare(console(client), terminal_size=size, run_before=then(keys("l", "3"), searched))


@pytest.mark.parametrize("size", SIZES)
def test_setup_form(snap_compare: Snap, size: tuple[int, int]) -> None:
    async def form(pilot: Pilot[Any]) -> None:
        await screen_of(pilot, LogsScreen)
        await pilot.press("3", "s")
        await screen_of(pilot, SetupModal)

    client = FakeProvisioningClient(sample_fleet(), metrics=SAMPLE_METRICS)
    assert snap_compare(console(client), terminal_size=size, run_before=then(keys("l"), form))


@pytest.mark.parametrize("size", SIZES)
def test_models(snap_compare: Snap, size: tuple[int, int]) -> None:
    async def loaded(pilot: Pilot[Any]) -> None:
        screen = await screen_of(pilot, ModelsScreen)
        await wait_for(pilot, lambda: downloads_filled(screen), what="the downloads, their bars filled")
        await pilot.pause()

    client = FakeModelsClient(sample_fleet(), metrics=SAMPLE_METRICS)
    assert snap_compare(console(client), terminal_size=size, run_before=then(keys("m"), loaded))


@pytest.mark.parametrize("size", SIZES)
def test_deployments(snap_compare: Snap, size: tuple[int, int]) -> None:
    async def coder(pilot: Pilot[Any]) -> None:
        screen = await screen_of(pilot, DeploymentsScreen)
        table = screen.query_one("#deployments", DataTable)
        await wait_for(pilot, lambda: table.row_count == 3, what="the deployments")
        await pilot.press("down")
        events = screen.query_one("#deployment-events", LogView)
        await wait_for(pilot, lambda: screen.selected == "coder" and len(events.records) == 7, what="coder's events")
        await pilot.pause()

    client = FakeDeploymentsClient(sample_fleet(), metrics=SAMPLE_METRICS)
    assert snap_compare(console(client), terminal_size=size, run_before=then(keys("a"), coder))


@pytest.mark.parametrize("size", SIZES)
def test_download_dialog(snap_compare: Snap, size: tuple[int, int]) -> None:
    async def loaded(pilot: Pilot[Any]) -> None:
        screen = await screen_of(pilot, ModelsScreen)
        await wait_for(pilot, lambda: downloads_filled(screen), what="the downloads, their bars filled")

    async def typed(pilot: Pilot[Any]) -> None:
        await screen_of(pilot, DownloadModal)
        await pilot.press(*"Qwen/Qwen3-8B-GGUF", "tab", *"v2")

    client = FakeModelsClient(sample_fleet(), metrics=SAMPLE_METRICS)
    assert snap_compare(console(client), terminal_size=size, run_before=then(keys("m"), loaded, keys("d"), typed))


@pytest.mark.parametrize("size", SIZES)
def test_command_line(snap_compare: Snap, size: tuple[int, int]) -> None:
    # Tab lists the nodes that fit; the line and the fleet under it stay.
    steps = then(keys("colon"), shows(CommandLine), keys(*"drain gpu", "tab"))
    assert snap_compare(console(), terminal_size=size, run_before=steps)


@pytest.mark.parametrize("size", SIZES)
def test_command_line_error(snap_compare: Snap, size: tuple[int, int]) -> None:
    steps = then(keys("colon"), shows(CommandLine), keys(*"drain gpu-9", "enter"))
    assert snap_compare(console(), terminal_size=size, run_before=steps)


@pytest.mark.parametrize("size", SIZES)
def test_key_map(snap_compare: Snap, size: tuple[int, int]) -> None:
    assert snap_compare(console(), terminal_size=size, run_before=then(keys("question_mark"), shows(HelpScreen)))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(
    "error",
    [
        pytest.param(DaemonUnreachable("The daemon at http://127.0.0.1:8080 does not answer."), id="down"),
        pytest.param(Unauthorized("The daemon at http://127.0.0.1:8080 refused the admin credentials."), id="refused"),
    ],
)
def test_connection(snap_compare: Snap, size: tuple[int, int], error: ClientError) -> None:
    app = console(FakeClient(fail=error))

    async def problem(pilot: Pilot[Any]) -> None:
        screen = await screen_of(pilot, ConnectionScreen)
        await wait_for(pilot, lambda: bool(str(screen.query_one("#problem-retry").render())))

    app.connection.retry_delays_s = (60.0,)
    assert snap_compare(app, terminal_size=size, run_before=problem)


@pytest.mark.parametrize("size", SIZES)
def test_confirm_drain_of_the_last_healthy_node(snap_compare: Snap, size: tuple[int, int]) -> None:
    async def drain(pilot: Pilot[Any]) -> None:
        app = pilot.app
        assert isinstance(app, QiipConsole)
        app.node_action("drain", "cpu01")  # the only node of tiny-chat
        await screen_of(pilot, ConfirmModal)

    assert snap_compare(console(), terminal_size=size, run_before=then(drain))


@pytest.mark.parametrize("size", SIZES)
def test_sizing_editor_forecast(snap_compare: Snap, size: tuple[int, int]) -> None:
    fleet = sample_fleet()
    cpu01 = next(n for n in fleet if n.id == "cpu01")
    assert cpu01.llamacpp_runtime is not None
    memory = [{"kind": "kv", "cells": 4096, "layers": 8, "type_k": "f16", "type_v": "f16", "mib": 64.0}]
    fleet[fleet.index(cpu01)] = cpu01.model_copy(
        update={"llamacpp_runtime": cpu01.llamacpp_runtime.model_copy(update={"memory": memory})}
    )

    async def relaunch(pilot: Pilot[Any]) -> None:
        app = pilot.app
        assert isinstance(app, QiipConsole)
        app.node_action("relaunch", "cpu01")
        await screen_of(pilot, SizingScreen)
        await pilot.click("#slots")
        await pilot.press("end", "backspace", "4")

    client = FakeClient(fleet, metrics=SAMPLE_METRICS)
    assert snap_compare(console(client), terminal_size=size, run_before=then(relaunch))


@pytest.mark.parametrize("size", SIZES)
def test_what_fits_a_host(snap_compare: Snap, size: tuple[int, int]) -> None:
    async def answered(pilot: Pilot[Any]) -> None:
        screen = await screen_of(pilot, RecommendationsScreen)
        await wait_for(pilot, lambda: screen.found is not None, what="the recommendations")

    steps = then(keys("slash", *"gpu02", "enter", "enter"), shows(NodeScreen), keys("w"), answered)
    client = FakeRecommendationsClient(sample_fleet(), metrics=SAMPLE_METRICS)
    assert snap_compare(console(client), terminal_size=size, run_before=steps)


def live_fleet() -> list[NodeInfo]:
    """The sample fleet, gpu01 with a live reading of its two GPUs from `qiip agent`, taken a second ago."""
    gpus = [
        {
            "index": i,
            "name": "NVIDIA H100 80GB HBM3",
            "uuid": f"GPU-{i}",
            "memory_used_mib": used,
            "memory_total_mib": 81920,
            "utilization_percent": util,
            "temperature_c": temp,
            "power_w": power,
        }
        for i, (used, util, temp, power) in enumerate(((64000, 93, 71, 612.4), (30500, 41, 58, None)))
    ]
    live = {
        "read_at": (NOW - timedelta(seconds=1)).isoformat(),
        "age_s": 1.0,
        "stale": False,
        "interval_s": 1.0,
        "gpus": gpus,
    }
    return [
        NodeInfo.model_validate({**info.model_dump(), "gpus_live": live}) if info.id == "gpu01" else info
        for info in sample_fleet()
    ]


@pytest.mark.parametrize("size", SIZES)
def test_node_with_live_gpus(snap_compare: Snap, size: tuple[int, int]) -> None:
    steps = then(keys("slash", *"gpu01", "enter", "enter"), shows(NodeScreen))
    client = FakeClient(live_fleet(), metrics=SAMPLE_METRICS)
    assert snap_compare(console(client), terminal_size=size, run_before=steps)


@pytest.mark.parametrize("size", SIZES)
def test_fleet_with_quads(snap_compare: Snap, size: tuple[int, int]) -> None:
    assert snap_compare(console(FakeQuadsClient()), terminal_size=size, run_before=then())


@pytest.mark.parametrize("size", SIZES)
def test_fleet_with_stale_quads_data(snap_compare: Snap, size: tuple[int, int]) -> None:
    assert snap_compare(console(FakeQuadsClient(stale_age_s=12 * 60)), terminal_size=size, run_before=then())


@pytest.mark.parametrize("size", SIZES)
def test_node_on_a_quads_host(snap_compare: Snap, size: tuple[int, int]) -> None:
    steps = then(keys("slash", *"gpu03", "enter", "enter"), shows(NodeScreen))
    assert snap_compare(console(FakeQuadsClient()), terminal_size=size, run_before=steps)
