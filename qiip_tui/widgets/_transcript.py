"""The chat transcript: every turn with its prompt, its answer as it streams, how it ended, which node
answered and the time to its first token."""

from __future__ import annotations

from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from qiip_tui._chat import Turn, TurnState
from qiip_tui._render import ttft_text

__all__ = ["Transcript"]


class _TurnView(Static):
    DEFAULT_CSS = """
    _TurnView {
        margin: 0 0 1 0;
        &.-failed, &.-cancelled { border-left: outer $error; padding-left: 1; }
    }
    """


class Transcript(VerticalScroll):
    """The turns of a conversation. The owner calls `show(turn)` when a turn starts, grows or ends."""

    DEFAULT_CSS = """
    Transcript {
        height: 1fr;
        padding: 0 1;
        background: $surface;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._views: dict[int, _TurnView] = {}

    def show(self, turn: Turn, *, tokens_per_s: float | None = None) -> None:
        """Render a turn (mounting it the first time)."""
        view = self._views.get(id(turn))
        if view is None:
            view = _TurnView(markup=False)
            self._views[id(turn)] = view
            self.mount(view)
        view.set_class(turn.state is TurnState.FAILED, "-failed")
        view.set_class(turn.state is TurnState.CANCELLED, "-cancelled")
        view.update(self._render_turn(turn, tokens_per_s))
        self.scroll_end(animate=False)

    def clear(self) -> None:
        """Forget every turn."""
        self._views.clear()
        self.remove_children()

    def _render_turn(self, turn: Turn, tokens_per_s: float | None) -> Text:
        text = Text("you: ", style="bold")
        text.append(turn.prompt)
        text.append(f"\n{turn.model}: ", style="bold")
        text.append(turn.answer or ("…" if turn.state is TurnState.STREAMING else ""))
        rate = f" · {tokens_per_s:.1f} tok/s" if tokens_per_s is not None else ""
        ending = {
            TurnState.STREAMING: f"streaming · {turn.tokens} tokens{rate}",
            TurnState.DONE: f"{turn.tokens} tokens{rate} · {turn.finish_reason or 'done'}",
            TurnState.CANCELLED: f"cancelled after {turn.tokens} tokens (not sent as history)",
            TurnState.FAILED: f"failed after {turn.tokens} tokens: {turn.error} (not sent as history)",
        }[turn.state]
        text.append(f"\n[{ending}{_answered_by(turn)}]", style="italic dim")
        return text


def _answered_by(turn: Turn) -> str:
    """` · answered by chat-a · TTFT 120ms`, as far as it is known."""
    parts = [f"answered by {turn.node}"] if turn.node else []
    ttft = turn.ttft_s
    if ttft is not None:
        parts.append(f"TTFT {ttft_text(ttft)}")
    return "".join(f" · {part}" for part in parts)
