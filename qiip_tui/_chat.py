"""A chat conversation: turns, their states, and which of them the next request sends as history; and the
models the chat offers, as the fleet serves them.

Pure. A turn that failed or was cancelled stays in the transcript with its partial answer, but neither its
prompt nor its answer goes into the next request: the model would otherwise continue from a half-answer the
operator abandoned.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from qiip_core.client import NodeInfo
from qiip_core.nodes import NodeStatus

__all__ = ["Conversation", "ModelChoice", "Turn", "TurnState", "model_choices"]


class TurnState(Enum):
    """Where a turn is."""

    STREAMING = "streaming"
    """The answer is arriving."""
    DONE = "done"
    """The answer ended; the turn is history."""
    CANCELLED = "cancelled"
    """The operator stopped it; kept on screen only."""
    FAILED = "failed"
    """The daemon or the node failed; kept on screen only."""


@dataclass(eq=False)
class Turn:
    """One prompt and its answer; turns compare by identity."""

    prompt: str
    """What the operator sent."""
    model: str
    """The model asked."""
    started_s: float
    """When it was sent, on the console's clock, in seconds."""
    answer: str = ""
    """The answer so far."""
    state: TurnState = TurnState.STREAMING
    """Where it is."""
    error: str | None = None
    """Why it failed."""
    tokens: int = 0
    """Tokens received: one per streamed piece, or the usage the stream reported at its end."""
    first_token_s: float | None = None
    """When the first piece arrived."""
    finished_s: float | None = None
    """When it ended, however it ended."""
    finish_reason: str | None = None
    """`stop`, `length`, … as the stream said."""
    node: str | None = None
    """The node that answered, as the daemon named it (`X-QIIP-Node`); None until it says."""

    @property
    def ttft_s(self) -> float | None:
        """Time to first token in seconds: from sending the request to the first piece of text; None before."""
        return None if self.first_token_s is None else max(0.0, self.first_token_s - self.started_s)

    def add(self, content: str, *, at_s: float) -> None:
        """Append a streamed piece."""
        if not content:
            return
        if self.first_token_s is None:
            self.first_token_s = at_s
        self.answer += content
        self.tokens += 1

    def finish(self, state: TurnState, *, at_s: float, error: str | None = None) -> None:
        """End the turn (the first ending wins)."""
        if self.state is TurnState.STREAMING:
            self.state, self.finished_s, self.error = state, at_s, error

    def tokens_per_s(self, now_s: float) -> float | None:
        """Tokens per second since the first token (to the end, once ended); None before two tokens."""
        if self.first_token_s is None or self.tokens < 2:
            return None
        end = self.finished_s if self.finished_s is not None else now_s
        elapsed = end - self.first_token_s
        # The first token starts the clock, so it is not counted in the rate.
        return (self.tokens - 1) / elapsed if elapsed > 0 else None


@dataclass
class Conversation:
    """The turns of one chat, and the optional system prompt."""

    system_prompt: str = ""
    """Sent first when not blank."""
    turns: list[Turn] = field(default_factory=list)
    """Every turn, oldest first, whatever its state."""

    @property
    def streaming(self) -> Turn | None:
        """The turn still arriving, if any."""
        return self.turns[-1] if self.turns and self.turns[-1].state is TurnState.STREAMING else None

    def messages_for(self, prompt: str) -> list[dict[str, str]]:
        """The request's `messages`: the system prompt, the finished turns, and `prompt`."""
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt.strip() else []
        for turn in self.turns:
            if turn.state is TurnState.DONE:
                messages.append({"role": "user", "content": turn.prompt})
                messages.append({"role": "assistant", "content": turn.answer})
        messages.append({"role": "user", "content": prompt})
        return messages

    def start(self, prompt: str, *, model: str, at_s: float) -> tuple[Turn, list[dict[str, str]]]:
        """Begin a turn.

        Returns:
            The turn, and the messages to send for it.
        """
        messages = self.messages_for(prompt)
        turn = Turn(prompt=prompt, model=model, started_s=at_s)
        self.turns.append(turn)
        return turn, messages


@dataclass(frozen=True)
class ModelChoice:
    """A model the chat offers."""

    model: str
    """The model id."""
    healthy: bool = True
    """Some healthy node serves it; when False its nodes are all unhealthy, draining or restarting."""

    @property
    def label(self) -> str:
        """What the model list shows."""
        return self.model if self.healthy else f"{self.model} (no healthy node)"


def model_choices(listed: Sequence[str], nodes: Iterable[NodeInfo]) -> list[ModelChoice]:
    """The models to offer: the daemon's list, kept true to the fleet as it changes.

    Args:
        listed: the daemon's model list (`client.models()`), in its order.
        nodes: every node of the fleet; none while the fleet is not known yet.

    Returns:
        With no nodes, `listed` as it is. Else the listed models some node still serves, then models a
        healthy node serves that the list lacks (sorted); a model whose nodes are all out of service is kept
        and marked, one that no node serves any more is dropped.
    """
    healthy: dict[str, bool] = {}
    for node in nodes:
        healthy[node.model] = healthy.get(node.model, False) or node.status == NodeStatus.HEALTHY
    if not healthy:
        return [ModelChoice(model) for model in listed]
    kept = [ModelChoice(model, healthy[model]) for model in listed if model in healthy]
    added = [ModelChoice(model) for model in sorted(healthy) if healthy[model] and model not in listed]
    return kept + added
