"""Client configs from the command palette: the file lands in QIIP's own directory, a notification says where,
and an `openai` client built from it reaches the model through the gateway."""

from __future__ import annotations

from pathlib import Path

import pytest

from qiip_core.clientconfig import PLACEHOLDER_KEY, ClientKind
from qiip_tui import QiipConsole
from qiip_tui._commands import console_commands
from tests.support.client_configs import read_back
from tests.support.daemon import Daemon
from tests.support.openai_client import openai_client
from tests.tui.conftest import config_for, wait_for

pytestmark = pytest.mark.integration


async def test_the_palette_writes_a_config_and_says_where(console_daemon: Daemon, config_home: Path) -> None:
    app = QiipConsole(config_for(console_daemon))
    written = config_home / "qiip" / "client-configs" / "pi" / "tiny-chat" / "models.json"
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(pilot, lambda: "tiny-chat" in {n.model for n in app.fleet.nodes.values()}, what="the fleet")
        names = [command.name for command in console_commands(app)]
        for kind in ClientKind:
            assert f"Client config: {kind.value} for tiny-chat" in names
            assert f"Client config: {kind.value} for slow-model" in names
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"Client config: pi for tiny-chat")
        await pilot.pause()
        await pilot.press("enter")
        await wait_for(pilot, lambda: any(n.title.startswith("Client config") for n in app._notifications))
        (note,) = [n for n in app._notifications if n.title.startswith("Client config")]
        assert note.title == "Client config: pi for tiny-chat"
        assert note.message.startswith(f"Wrote {written}. pi reads it from ~/.pi/agent/models.json")
    back = read_back(ClientKind.PI, written.read_text())
    assert (back.base_url, back.model, back.api_key) == (console_daemon.url + "/v1", "tiny-chat", PLACEHOLDER_KEY)
    reply = openai_client(back.base_url, api_key=back.api_key).chat.completions.create(
        model=back.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices
