"""The provisioning screen against a real daemon: a setup started from the console, its task and its live log.

The host is 127.0.0.1 with nothing listening on the daemon's SSH port, so the daemon's real setup fails at once
at `waiting_for_ssh`: a real task record and a real log, without installing anything. Cancel and power are
refused by the same daemon (nothing runs on the host; no BMC is configured), which shows how a refusal reads.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import DataTable, Input, Label, RichLog, Select

from qiip_core.nodes import Engine
from qiip_tui import QiipConsole
from qiip_tui._commands import console_commands
from qiip_tui._provisioning import setup_sizing
from qiip_tui.screens import ConfirmModal, LogsScreen
from qiip_tui.screens._setup import SetupModal
from qiip_tui.widgets import LogView
from tests.support.daemon import Daemon, free_port
from tests.tui.conftest import config_for, screen_of, wait_for

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def refusing_daemon(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Iterator[Daemon]:
    """A daemon whose hosts' SSH port is closed: every setup fails at `waiting_for_ssh` within half a second. Its
    shared model cache holds the tiny model, so a llama.cpp setup's sizing is checked against it."""
    cache = tmp_path_factory.mktemp("models")
    shutil.copy(tiny_gguf, cache / "tiny.gguf")
    env = {
        "QIIP_PROVISIONING__SSH_PORT": str(free_port()),
        "QIIP_PROVISIONING__SSH_WAIT_TIMEOUT_S": "0.5",
        "QIIP_PROVISIONING__CONNECT_TIMEOUT_S": "0.5",
        "QIIP_PROVISIONING__PROFILE": "cpu",
        "QIIP_PROVISIONING__MODEL_CACHE_DIR": str(cache),
    }
    with Daemon(tmp_path_factory.mktemp("provisioning") / "state", env=env) as daemon:
        yield daemon


def notes(app: QiipConsole, title: str) -> list[Any]:
    return [n for n in app._notifications if n.title == title]


async def test_a_setup_from_the_console_shows_its_task_and_live_log(refusing_daemon: Daemon) -> None:
    app = QiipConsole(config_for(refusing_daemon), node_poll_s=0.2, operation_poll_s=0.1)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("l")
        screen = await screen_of(pilot, LogsScreen)
        await pilot.press("s")  # the provisioning pane's key: nothing on the timeline
        assert isinstance(app.screen, LogsScreen)
        await pilot.press("3", "s")
        form = await screen_of(pilot, SetupModal)
        form.query_one("#setup-host", Input).value = HOST
        form.query_one("#setup-model", Input).value = "tiny.gguf"
        form.query_one("#setup-model", Input).focus()
        await pilot.press("enter")
        confirm = await screen_of(pilot, ConfirmModal)
        assert confirm.question == f"Set {HOST} up?"
        await pilot.press("y")
        screen = await screen_of(pilot, LogsScreen)

        table = screen.query_one("#tasks", DataTable)
        await wait_for(pilot, lambda: HOST in {r.value for r in table.rows} and str(table.get_row_at(0)[5]) == "failed")
        assert [str(cell) for cell in table.get_row_at(0)][:4] == [HOST, "setup", "vLLM", "waiting_for_ssh"]
        view = screen.query_one("#log-view", LogView)
        await wait_for(pilot, lambda: any("setup failed" in r.message for r in view.records), what="the log")
        failed = next(r for r in view.records if "setup failed" in r.message)
        assert failed.level == "error" and failed.source == "waiting_for_ssh"
        assert "connection refused" in failed.message

        view.query_one(RichLog).focus()
        await pilot.press("slash", *"refused")
        await wait_for(pilot, lambda: view.search_text == "refused")
        assert len(view.query_one(RichLog).lines) == 1
        await pilot.press("escape")

        # The operation the console started ends as failed, and says so.
        await wait_for(pilot, lambda: notes(app, f"Setup {HOST} failed"), what="the failure notice")


def test_the_setup_forms_sizing_is_auto_or_slots_by_context() -> None:
    assert setup_sizing("") is None and setup_sizing(" Auto ") is None
    assert setup_sizing("2x4,096") == {
        "sizing": "custom",
        "slots": 2,
        "context_per_slot": 4096,
        "cache_type": "f16",
        "fit_target_mib": 512,
    }
    assert setup_sizing("4 × 8192") is not None
    with pytest.raises(ValueError, match="neither auto nor SLOTSxCONTEXT, such as 2x4096"):
        setup_sizing("lots")


async def test_the_setup_form_sends_its_sizing_and_the_daemon_answers_with_the_field(refusing_daemon: Daemon) -> None:
    app = QiipConsole(config_for(refusing_daemon), node_poll_s=0.2, operation_poll_s=0.1)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("l")
        await screen_of(pilot, LogsScreen)
        await pilot.press("3", "s")  # host keys act on the provisioning pane
        form = await screen_of(pilot, SetupModal)
        form.query_one("#setup-host", Input).value = HOST
        form.query_one("#setup-engine", Select).value = Engine.LLAMA_CPP
        form.query_one("#setup-model", Input).value = "tiny.gguf"
        form.query_one("#setup-sizing", Input).value = "lots"
        form.query_one("#setup-sizing", Input).focus()
        await pilot.press("enter")
        assert "neither auto nor SLOTSxCONTEXT" in str(form.query_one("#setup-problem", Label).render())
        form.query_one("#setup-sizing", Input).value = "0x512"
        await pilot.press("enter")
        confirm = await screen_of(pilot, ConfirmModal)
        assert "with 0 slot(s) of 512 tokens" in str(confirm.body)
        await pilot.press("y")
        refusal = f"Set up {HOST}"
        await wait_for(pilot, lambda: notes(app, refusal), what="the refusal")
        assert "slots must be between 1 and 256, got 0" in str(notes(app, refusal)[0].message)


async def test_refused_host_actions_name_the_host_and_the_reason(refusing_daemon: Daemon) -> None:
    app = QiipConsole(config_for(refusing_daemon), node_poll_s=0.2)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("l")
        await screen_of(pilot, LogsScreen)
        app.selection.host = HOST
        names = {command.name for command in console_commands(app)}
        assert {f"Cancel provisioning {HOST}", f"Tear down {HOST}", f"Power off {HOST}", "Set up a host"} <= names

        await pilot.press("3")
        app.selection.host = HOST
        await pilot.press("o")
        assert (await screen_of(pilot, ConfirmModal)).question == f"Power on {HOST}?"
        await pilot.press("y")
        await wait_for(pilot, lambda: notes(app, f"Power on {HOST}"), what="the power refusal")
        (note,) = notes(app, f"Power on {HOST}")
        assert note.message.startswith(f"Power on {HOST} refused: No BMC is configured for {HOST}")
        assert "\n" not in note.message

        await screen_of(pilot, LogsScreen)
        await pilot.press("n")  # a stray answer does nothing on the screen itself
        app.host_action("teardown", "not-a-node")
        await screen_of(pilot, ConfirmModal)
        await pilot.press("n")
        await screen_of(pilot, LogsScreen)
        assert not notes(app, "Tear down not-a-node")
        app.host_action("teardown", "not-a-node")
        await screen_of(pilot, ConfirmModal)
        await pilot.press("y")
        await wait_for(pilot, lambda: notes(app, "Tear down not-a-node"), what="the teardown refusal")
        (note,) = notes(app, "Tear down not-a-node")
        assert note.message.startswith("Tear down not-a-node refused: No node is registered")


def test_no_console_module_is_over_600_lines() -> None:
    package = Path(__file__).resolve().parents[2] / "qiip_tui"
    assert package.is_dir()
    for path in package.rglob("*.py"):
        assert len(path.read_text().splitlines()) <= 600, path


async def test_the_power_key_says_what_the_bmc_says(refusing_daemon: Daemon) -> None:
    backend_port = free_port()
    refusing_daemon.add_node("powered", f"http://127.0.0.1:{backend_port}", "m", wait=False)
    app = QiipConsole(config_for(refusing_daemon), node_poll_s=0.2)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(pilot, lambda: "powered" in app.fleet.nodes, what="the node")
        app.node_action("power", "powered")
        await wait_for(pilot, lambda: notes(app, "Power powered"), what="the power state")
        (note,) = notes(app, "Power powered")
        # No BMC here: the daemon's one-line reason, naming the host.
        assert note.message.startswith("Power of 127.0.0.1 unknown: No BMC is configured for 127.0.0.1")
