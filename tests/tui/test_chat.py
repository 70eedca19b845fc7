"""The chat screen against a real daemon: a streamed turn from llama.cpp, and Esc closing a stream mid-way."""

from __future__ import annotations

import json

import pytest
from textual.pilot import Pilot
from textual.widgets import Input, Label, Select

from qiip_tui import QiipConsole
from qiip_tui._chat import TurnState
from qiip_tui._render import ttft_text
from qiip_tui.screens import ChatScreen
from qiip_tui.widgets import Transcript
from tests.support.daemon import Daemon
from tests.support.fault_backend import FaultBackend, Sse
from tests.tui.conftest import config_for, in_thread, screen_of, wait_for
from tests.tui.fakes import FakeClient
from tests.tui.samples import node

pytestmark = pytest.mark.integration


async def open_chat(pilot: Pilot[None], model: str) -> ChatScreen:
    await pilot.press("c")
    screen = await screen_of(pilot, ChatScreen)
    status = screen.query_one("#chat-status", Label)
    await wait_for(pilot, lambda: "models available" in str(status.render()), what="the model list")
    screen.query_one("#model", Select).value = model
    return screen


async def test_a_turn_streams_from_a_llama_cpp_node(console_daemon: Daemon) -> None:
    app = QiipConsole(config_for(console_daemon), chat_max_tokens=12)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.connection.connected, what="the connection")
        screen = await open_chat(pilot, "tiny-chat")
        await pilot.press(*"Say hello", "enter")
        await wait_for(pilot, lambda: bool(screen.conversation.turns), what="the turn to start")
        turn = screen.conversation.turns[0]
        await wait_for(pilot, lambda: turn.state is not TurnState.STREAMING, what="the answer")
        assert turn.state is TurnState.DONE, turn.error
        # Sampled from random weights: usually all 12 tokens, now and then an end-of-sequence, which may be the 12th.
        assert turn.answer and (
            (turn.tokens == 12 and turn.finish_reason == "length")
            or (turn.tokens <= 12 and turn.finish_reason == "stop")
        )
        shown = str(screen.query_one(Transcript).children[0].render())
        assert "Say hello" in shown and turn.answer[:10] in shown and f"{turn.tokens} tokens" in shown


async def test_escape_cancels_a_running_stream_and_the_node_sees_the_disconnect(
    console_daemon: Daemon, slow_backend: FaultBackend
) -> None:
    slow_backend.reset()
    slow_backend.push(Sse(n_events=100, delay_between_s=0.1))
    app = QiipConsole(config_for(console_daemon))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.connection.connected, what="the connection")
        screen = await open_chat(pilot, "slow-model")
        await pilot.press(*"count to a hundred", "enter")
        await wait_for(pilot, lambda: bool(screen.conversation.turns), what="the turn to start")
        turn = screen.conversation.turns[0]
        await wait_for(pilot, lambda: turn.tokens >= 3, what="a few tokens")
        await pilot.press("escape")
        await wait_for(pilot, lambda: turn.state is TurnState.CANCELLED, what="the turn to be cancelled")
        chat = next(i for i, r in enumerate(slow_backend.requests) if r.path == "/v1/chat/completions")
        await in_thread(lambda: slow_backend.wait_for_disconnect(chat))
        partial = turn.answer
        assert partial.startswith("tok0 tok1 tok2 ") and len(partial.split()) < 100
        shown = str(screen.query_one(Transcript).children[0].render())
        assert partial.strip() in shown and "cancelled" in shown

        # The next request does not carry the cancelled turn as history.
        await pilot.press(*"again", "enter")
        await wait_for(pilot, lambda: len(screen.conversation.turns) == 2, what="the second turn")
        second = screen.conversation.turns[1]
        await wait_for(pilot, lambda: second.state is not TurnState.STREAMING, what="the second answer")
        assert second.state is TurnState.DONE
        chats = [r for r in slow_backend.requests if r.path == "/v1/chat/completions"]
        sent = json.loads(chats[-1].body)["messages"]
        assert sent == [{"role": "user", "content": "again"}]


async def test_a_model_that_is_no_longer_served_is_not_swapped_for_another() -> None:
    first, second = node("n1", model="first"), node("n2", model="second")
    client = FakeClient([first, second], models=["first", "second"])
    app = QiipConsole(client=client, metrics_interval_s=3600, node_poll_s=3600)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("c")
        chat = await screen_of(pilot, ChatScreen)
        select = chat.query_one("#model", Select)
        await wait_for(pilot, lambda: select.value == "first", what="the first model chosen")
        select.value = "second"
        client.model_ids = ["first"]
        client.push("removed", second)
        await wait_for(pilot, select.is_blank, what="the choice to be cleared")
        status = str(chat.query_one("#chat-status", Label).render())
        assert "second is no longer served; choose a model." in status
        await pilot.press(*"hello", "enter")
        await pilot.pause()
        assert "Choose a model first" in str(chat.query_one("#chat-status", Label).render())


async def test_the_model_list_follows_the_fleet_live(console_daemon: Daemon) -> None:
    with FaultBackend(model="passing-model") as backend:
        console_daemon.add_node("passing", backend.url, "passing-model")
        try:
            app = QiipConsole(config_for(console_daemon))
            async with app.run_test(size=(100, 30)) as pilot:
                await wait_for(pilot, lambda: app.connection.connected, what="the connection")
                screen = await open_chat(pilot, "passing-model")
                select = screen.query_one("#model", Select)

                def label_of(model: str) -> str | None:
                    return next((c.label for c in screen.choices if c.model == model), None)

                # Drained, its only node serves nothing new: the model stays, marked, and stays chosen.
                drained = await in_thread(lambda: console_daemon.admin.post("/admin/nodes/passing/drain", json={}))
                assert drained.status_code == 202, drained.text
                await wait_for(
                    pilot, lambda: label_of("passing-model") == "passing-model (no healthy node)", what="the mark"
                )
                assert select.value == "passing-model"

                # Removed: no node serves it any more; the choice is cleared and the status says why.
                await in_thread(lambda: console_daemon.remove_node("passing"))
                await wait_for(pilot, lambda: label_of("passing-model") is None, what="the model to leave")
                assert select.is_blank()
                assert str(screen.query_one("#chat-status", Label).render()) == (
                    "passing-model is no longer served; choose a model."
                )
                assert label_of("tiny-chat") == "tiny-chat"
        finally:
            if "passing" in console_daemon.node_statuses():
                console_daemon.remove_node("passing")


async def test_the_message_box_keeps_the_focus(console_daemon: Daemon) -> None:
    app = QiipConsole(config_for(console_daemon), chat_max_tokens=4)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.connection.connected, what="the connection")
        await pilot.press("c")
        screen = await screen_of(pilot, ChatScreen)
        prompt = screen.query_one("#prompt", Input)
        status = screen.query_one("#chat-status", Label)
        await wait_for(pilot, lambda: "models available" in str(status.render()), what="the model list")
        # Choose a model with the keyboard, in the list itself.
        await pilot.click("#model")
        await wait_for(pilot, lambda: screen.query_one("#model", Select).expanded, what="the list to open")
        choices = [c.model for c in screen.choices]
        # The list's first line is the blank prompt.
        await pilot.press("home", *["down"] * (choices.index("tiny-chat") + 1), "enter")
        await wait_for(pilot, lambda: screen.query_one("#model", Select).value == "tiny-chat", what="the choice")
        assert app.focused is prompt
        # Keys the app or the screen binds go into the message instead.
        await pilot.press("l", "space", "q", "f", "m", "c", "question_mark")
        assert app.screen is screen and prompt.value == "l qfmc?"

        # Away to the fleet and back with the app's chat key: the message box has the focus again.
        await pilot.press("ctrl+u", "escape")
        await wait_for(pilot, lambda: app.screen is not screen, what="the fleet")
        await pilot.press("c")
        await wait_for(pilot, lambda: app.screen is screen, what="the chat again")
        await pilot.pause()
        assert app.focused is prompt

        # The answer names the node that answered and the time to its first token.
        await pilot.press(*"hi", "enter")
        await wait_for(pilot, lambda: bool(screen.conversation.turns), what="the turn to start")
        turn = screen.conversation.turns[0]
        await wait_for(pilot, lambda: turn.state is not TurnState.STREAMING, what="the answer")
        assert turn.node in {"chat-a", "chat-b"} and turn.ttft_s is not None
        shown = str(screen.query_one(Transcript).children[0].render())
        assert f"answered by {turn.node} · TTFT {ttft_text(turn.ttft_s)}" in shown
