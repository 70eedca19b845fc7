"""The chat screen: talk to a model through the daemon, as a client would, to check a deployment end to end.

Tokens appear as they stream, with the rate, the node that answered and the time to first token. The model
list follows the fleet: a model no node serves any more leaves it, one whose nodes are all out of service is
marked. The message box has the focus whenever the screen shows, so every key typed goes into it.

Escape stops a running answer: cancelling the worker closes the stream, and the daemon then closes the node's
request. A turn that failed or was stopped stays on screen but is not sent as history (see `qiip_tui._chat`).
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Header, Input, Label, Select

from qiip_core.client import ChatDelta, ClientError
from qiip_tui._chat import Conversation, ModelChoice, Turn, TurnState, model_choices
from qiip_tui._fleet import FleetDelta
from qiip_tui.screens._base import ConsoleScreen
from qiip_tui.widgets import ConsoleInput, KeyFooter, Transcript

__all__ = ["ChatScreen"]


class ChatScreen(ConsoleScreen[None]):
    """A conversation with one model at a time."""

    AUTO_FOCUS = "#prompt"

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop_or_back", "Stop/back"),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("ctrl+r", "reload_models", "Reload models"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | enter | Send the prompt. |
    | escape | Stop the answer that is streaming; else back to the fleet. |
    | ctrl+l | Clear the transcript and the history. |
    | ctrl+r | Reload the model list. |
    """

    class Streamed(Message):
        """A piece of the answer arrived.

        Posted by `ChatScreen._stream`. Handled by `ChatScreen.on_chat_screen_streamed`.
        """

        def __init__(self, turn: Turn, delta: ChatDelta) -> None:
            super().__init__()
            self.turn = turn
            """The turn it belongs to."""
            self.delta = delta
            """The piece: text, and the finish reason or usage at the end."""

    class Ended(Message):
        """The answer ended: done, stopped or failed.

        Posted by `ChatScreen._stream`. Handled by `ChatScreen.on_chat_screen_ended`.
        """

        def __init__(self, turn: Turn, state: TurnState, error: str | None = None) -> None:
            super().__init__()
            self.turn = turn
            """The turn."""
            self.state = state
            """`DONE`, `CANCELLED` or `FAILED`."""
            self.error = error
            """Why it failed."""

    class ModelsLoaded(Message):
        """The daemon listed its models (or could not).

        Posted by `ChatScreen._load_models`. Handled by `ChatScreen.on_chat_screen_models_loaded`.
        """

        def __init__(self, models: list[str], error: str | None = None) -> None:
            super().__init__()
            self.models = models
            """Model ids served now."""
            self.error = error
            """Why the list could not be read."""

    def __init__(self) -> None:
        super().__init__()
        self.conversation = Conversation()
        """The turns so far."""
        self.listed: list[str] = []
        """The daemon's model list, as last read."""
        self.choices: list[ModelChoice] = []
        """What the model list offers now (`model_choices`)."""

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="chat-options"):
            yield Select[str]([], prompt="model", id="model", compact=True)
            yield ConsoleInput(placeholder="system prompt (optional)", id="system", compact=True)
        yield Transcript(id="transcript")
        yield Label("", id="chat-status")
        yield ConsoleInput(placeholder="message: Enter sends, Esc stops", id="prompt", compact=True)
        yield KeyFooter()

    def on_mount(self) -> None:
        self._load_models()
        self.query_one("#prompt", Input).focus()
        self.console.connection.signal.subscribe(self, self._connection_changed)
        self.console.fleet_signal.subscribe(self, self._fleet_changed)
        self.watch(self.query_one("#model", Select), "expanded", self._model_list_toggled, init=False)

    def on_screen_resume(self) -> None:
        # Back from another mode (the app's `c`) or a dialog: typing goes to the message, never to the
        # app's keys (`l` would open the logs).
        self.query_one("#prompt", Input).focus()

    def _model_list_toggled(self, expanded: bool) -> None:
        if not expanded:
            # The list closed (a model chosen, the same one again, or the list dismissed): the next keys are
            # the message's. After the refresh, as the Select focuses itself when its list closes.
            self.call_after_refresh(self.query_one("#prompt", Input).focus)

    def _connection_changed(self, _: object) -> None:
        if self.console.connection.connected:
            self._load_models()  # the daemon may serve other models after it comes back

    # -- models ------------------------------------------------------------------------------------------

    @work(exclusive=True, group="chat-models", exit_on_error=False)
    async def _load_models(self) -> None:
        try:
            models = await self.console.client.models()
        except ClientError as exc:
            self.post_message(self.ModelsLoaded([], exc.message))
            return
        self.post_message(self.ModelsLoaded(models))

    def on_chat_screen_models_loaded(self, message: ModelsLoaded) -> None:
        if not message.error:
            self.listed = message.models
        gone = self._show_choices(force=True)
        if gone is not None and not message.error:
            # Never move the next message to another model behind the operator's back.
            self._status(f"{gone} is no longer served; choose a model.")
        elif message.error:
            self._status(f"Could not list the models: {message.error}")
        elif not self.choices:
            self._status("No model is served by a healthy node now (ctrl+r reloads the list).")
        else:
            count = len(self.choices)
            self._status(f"{count} model{'s' if count != 1 else ''} available")

    def _fleet_changed(self, _: FleetDelta) -> None:
        gone = self._show_choices()
        if gone is not None:
            self._status(f"{gone} is no longer served; choose a model.")

    def _show_choices(self, *, force: bool = False) -> str | None:
        """Offer the models the fleet serves now, keeping the operator's choice while it is served.

        Returns:
            The chosen model when it just left the list, else None.
        """
        choices = model_choices(self.listed, self.console.fleet.nodes.values())
        if choices == self.choices and not force:
            return None  # an open list is not rebuilt under the operator's cursor for nothing
        self.choices = choices
        select = self.query_one("#model", Select)
        current = select.value
        models = [choice.model for choice in choices]
        gone = isinstance(current, str) and current not in models
        with self.prevent(Select.Changed):
            select.set_options((choice.label, choice.model) for choice in choices)
            if isinstance(current, str) and not gone:
                select.value = current
            elif not gone and models:
                select.value = models[0]
        return current if gone and isinstance(current, str) else None

    def action_reload_models(self) -> None:
        """Ask the daemon for its models again."""
        self._load_models()

    # -- turns -------------------------------------------------------------------------------------------

    @on(Input.Submitted, "#prompt")
    def _send(self, event: Input.Submitted) -> None:
        prompt = event.value.strip()
        model = self.query_one("#model", Select).value
        if not prompt:
            return
        if not isinstance(model, str):
            self._status("Choose a model first (ctrl+r reloads the list).")
            return
        if self.conversation.streaming is not None:
            self._status("An answer is still streaming: Esc stops it.")
            return
        event.input.value = ""
        self.conversation.system_prompt = self.query_one("#system", Input).value
        turn, messages = self.conversation.start(prompt, model=model, at_s=self.console.clock())
        self.query_one("#transcript", Transcript).show(turn)
        self._status(f"asking {model}…")
        self._stream(turn, messages)

    @work(exclusive=True, group="chat", exit_on_error=False)
    async def _stream(self, turn: Turn, messages: list[dict[str, str]]) -> None:
        try:
            async for delta in self.console.client.chat_stream(
                turn.model, messages, max_tokens=self.console.chat_max_tokens
            ):
                self.post_message(self.Streamed(turn, delta))
        except asyncio.CancelledError:
            self.post_message(self.Ended(turn, TurnState.CANCELLED))
            raise
        except ClientError as exc:
            self.post_message(self.Ended(turn, TurnState.FAILED, exc.message))
            return
        self.post_message(self.Ended(turn, TurnState.DONE))

    def on_chat_screen_streamed(self, message: Streamed) -> None:
        turn, delta, now = message.turn, message.delta, self.console.clock()
        if turn.state is not TurnState.STREAMING or turn not in self.conversation.turns:
            return
        turn.add(delta.content, at_s=now)
        if delta.node is not None:
            turn.node = delta.node
        if delta.finish_reason:
            turn.finish_reason = delta.finish_reason
        if delta.completion_tokens is not None:
            turn.tokens = delta.completion_tokens
        rate = turn.tokens_per_s(now)
        self.query_one("#transcript", Transcript).show(turn, tokens_per_s=rate)
        self._status(f"streaming from {turn.model}: {turn.tokens} tokens" + (f", {rate:.1f} tok/s" if rate else ""))

    def on_chat_screen_ended(self, message: Ended) -> None:
        turn, now = message.turn, self.console.clock()
        if turn not in self.conversation.turns:
            return  # a turn of a cleared conversation
        turn.finish(message.state, at_s=now, error=message.error)
        rate = turn.tokens_per_s(now)
        self.query_one("#transcript", Transcript).show(turn, tokens_per_s=rate)
        self._status(
            {
                TurnState.DONE: f"done: {turn.tokens} tokens" + (f" at {rate:.1f} tok/s" if rate else ""),
                TurnState.CANCELLED: "stopped; the partial answer is not sent as history",
                TurnState.FAILED: f"failed: {turn.error}",
            }.get(turn.state, "")
        )

    def action_stop_or_back(self) -> None:
        """Stop the streaming answer, or go back to the fleet when nothing streams."""
        if self.conversation.streaming is not None:
            self.workers.cancel_group(self, "chat")
        else:
            self.app.switch_mode("fleet")

    def action_clear(self) -> None:
        """Stop any answer and forget the conversation."""
        self.workers.cancel_group(self, "chat")
        self.conversation = Conversation()
        self.query_one("#transcript", Transcript).clear()
        self._status("")

    def _status(self, text: str) -> None:
        self.query_one("#chat-status", Label).update(text)
