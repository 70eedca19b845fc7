"""The sizing editor against a real llama.cpp node: the core's rules, beside the field, as the operator types."""

from __future__ import annotations

import pytest
from textual.widgets import Button, Input, Label

from qiip_tui import QiipConsole
from qiip_tui.screens import ConfirmModal, NodeScreen, SizingScreen
from tests.support.daemon import Daemon
from tests.tui.conftest import config_for, in_thread, screen_of, wait_for

pytestmark = pytest.mark.integration


async def test_the_editor_rejects_unaligned_and_too_long_contexts(console_daemon: Daemon) -> None:
    app = QiipConsole(config_for(console_daemon))
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(pilot, lambda: "chat-a" in app.fleet.nodes, what="chat-a")
        await pilot.press("enter")
        await screen_of(pilot, NodeScreen)
        await pilot.press("r")
        screen = await screen_of(pilot, SizingScreen)
        assert screen.node.id == "chat-a"
        message = screen.query_one("#context_per_slot-message", Label)
        apply = screen.query_one("#apply", Button)
        field = screen.query_one("#context_per_slot", Input)
        assert field.value == "2048" and not apply.disabled, "the node's own sizing is valid"

        async def type_context(value: str) -> None:
            await pilot.click("#context_per_slot")
            await pilot.press("end", *["backspace"] * len(field.value), *value)

        await type_context("1000")
        assert str(message.render()) == (
            "context_per_slot must be a positive multiple of 256 tokens, got 1000; try 768 or 1024."
        )
        assert apply.disabled
        preview = str(screen.query_one("#preview").render())
        assert "ceil256(1,000 × 2) = 2,048 tokens" in preview

        await type_context("4096")
        assert str(message.render()) == (
            "context_per_slot (4096 tokens) exceeds the model's training context of 2048 tokens."
        )
        assert apply.disabled

        await type_context("1024")
        assert str(message.render()) == "" and not apply.disabled
        await pilot.press("escape")
        assert isinstance(app.screen, NodeScreen)


async def test_edits_go_stale_when_the_node_is_relaunched_elsewhere_and_apply_relaunches(
    console_daemon: Daemon,
) -> None:
    app = QiipConsole(config_for(console_daemon), operation_poll_s=0.1)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(pilot, lambda: "chat-b" in app.fleet.nodes, what="chat-b")
        app.node_action("relaunch", "chat-b")
        screen = await screen_of(pilot, SizingScreen)
        await pilot.click("#slots")
        await pilot.press("backspace", "3")
        assert not screen.query_one("#apply", Button).disabled

        # Another operator relaunches the node meanwhile.
        elsewhere = {
            "sizing": "custom",
            "fit_target_mib": 512,
            "context_per_slot": 1024,
            "slots": 2,
            "cache_type": "f16",
        }
        started = await in_thread(
            lambda: console_daemon.admin.post("/admin/nodes/chat-b/llamacpp/relaunch", json=elsewhere)
        )
        assert started.status_code == 202, started.text
        await wait_for(pilot, lambda: screen.stale, timeout_s=60, what="the edits to go stale")
        assert screen.query_one("#apply", Button).disabled
        assert "stale" in str(screen.query_one("#stale").render())

        await pilot.press("ctrl+r")
        assert not screen.stale and screen.query_one("#context_per_slot", Input).value == "1024"
        await wait_for(pilot, lambda: app.fleet.nodes["chat-b"].status == "healthy", timeout_s=60, what="chat-b back")

        # Back to the original sizing, through the console: Apply, confirm, follow the operation.
        await pilot.click("#context_per_slot")
        await pilot.press("end", *["backspace"] * 4, *"2048")
        await pilot.press("ctrl+s")
        await screen_of(pilot, ConfirmModal)
        await pilot.press("y")
        await wait_for(
            pilot,
            lambda: any(op.kind == "relaunch" and op.state != "running" for op in app.operations.values()),
            timeout_s=60,
            what="the relaunch to end",
        )
        operation = next(op for op in app.operations.values() if op.kind == "relaunch")
        assert operation.state == "succeeded", operation.error
        runtime = app.fleet.nodes["chat-b"].llamacpp_runtime
        await wait_for(
            pilot,
            lambda: (
                (r := app.fleet.nodes["chat-b"].llamacpp_runtime) is not None
                and r.effective["context_per_slot"] == 2048
            ),
            what="the new runtime record",
        )
        assert runtime is not None
    await in_thread(lambda: console_daemon.wait_status("chat-b", "healthy", timeout_s=60))


async def test_every_field_shows_its_error_and_ctrl_s_says_why_it_does_not_send(console_daemon: Daemon) -> None:
    app = QiipConsole(config_for(console_daemon))
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(pilot, lambda: "chat-a" in app.fleet.nodes, what="chat-a")
        app.node_action("relaunch", "chat-a")
        screen = await screen_of(pilot, SizingScreen)
        await pilot.click("#custom")
        preview = screen.query_one("#preview")
        runtime = app.fleet.nodes["chat-a"].llamacpp_runtime
        assert runtime is not None and runtime.memory, "the tiny model's caches are modelled"
        kv_now = sum(float(cache["mib"]) for cache in runtime.memory)
        shown = str(preview.render())
        assert f"K/V cache: {kv_now:,.1f} MiB (running now: {kv_now:,.1f} MiB)" in shown
        assert "Free after: CPU " in shown and "Automatic would pick: " in shown

        async def retype(field_id: str, value: str) -> None:
            field = screen.query_one(f"#{field_id}", Input)
            await pilot.click(f"#{field_id}")
            await pilot.press("end", *["backspace"] * len(field.value), *value)

        # One field not a number, another breaking a rule: both say so at once.
        await retype("slots", "two")
        await retype("context_per_slot", "1000")
        assert str(screen.query_one("#slots-message", Label).render()) == (
            "slots must be a whole number of slots, got 'two'."
        )
        context_message = "context_per_slot must be a positive multiple of 256 tokens, got 1000; try 768 or 1024."
        assert str(screen.query_one("#context_per_slot-message", Label).render()) == context_message

        await pilot.press("ctrl+s")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmModal)
        assert str(screen.query_one("#sizing-message", Label).render()) == (
            f"Not applied: Context per slot: {context_message} (1 more beside their fields)"
        )

        # A valid custom sizing: twice the cells, twice the cache.
        await retype("slots", "4")
        await retype("context_per_slot", "1024")
        shown = str(preview.render())
        assert f"K/V cache: {kv_now:,.1f} MiB" in shown, "1024 × 4 is the cells of 2048 × 2"
        await retype("context_per_slot", "2048")
        assert f"K/V cache: {2 * kv_now:,.1f} MiB" in str(preview.render())
        await pilot.press("ctrl+s")
        await screen_of(pilot, ConfirmModal)
        await pilot.press("n")
