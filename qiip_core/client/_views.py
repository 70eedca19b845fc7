"""The shapes of the daemon's admin API answers as the client reads them: nodes, events, operations, chat pieces.

Unknown keys are ignored, so a newer daemon's answers still parse.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from qiip_core.nodes import LlamaCppRuntime, NodeCapabilities
from qiip_core.telemetry import LiveGpus

__all__ = [
    "BreakerView",
    "ChatDelta",
    "HealthObservation",
    "HealthView",
    "LentHosts",
    "NodeErrorView",
    "NodeEvent",
    "NodeInfo",
    "OperationInfo",
    "QuadsFreshness",
    "QuadsReservationView",
    "QuadsView",
    "ResidentModelView",
    "SlotsView",
    "chat_delta",
    "lent_only",
]


class _View(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class BreakerView(_View):
    """A node's circuit breaker as the daemon sees it."""

    state: Literal["closed", "open", "half_open"] = "closed"
    consecutive_failures: int = 0


class HealthObservation(_View):
    """The daemon's last health observation of a node."""

    consecutive_failures: int = 0
    last_probe_at: datetime | None = None
    observed: bool = False


class SlotsView(_View):
    """A llama.cpp node's slots as the daemon's last probe read them (llama-server `GET /slots`)."""

    busy: int
    """Slots processing a request (`is_processing`)."""
    total: int
    """Slots of the server (`--parallel`)."""


class ResidentModelView(_View):
    """A model an Ollama node holds in memory, as the daemon's last probe read it (Ollama `GET /api/ps`)."""

    name: str
    """The model's name with its tag (`llama3.2:3b`)."""
    size_bytes: int
    """The memory it takes in all: weights and KV cache."""
    vram_bytes: int
    """The part of it in GPU memory; the rest runs on the CPU."""
    context_length: int | None = None
    """The context it was loaded with, in tokens."""
    expires_at: datetime | None = None
    """When the server unloads it unless a request keeps it."""


class QuadsReservationView(_View):
    """A QUADS reservation of a node's host."""

    start: datetime
    end: datetime
    assignment: str | None = None
    cloud: str | None = None
    owner: str | None = None


class QuadsView(_View):
    """What the QUADS scheduler says of a node's host (`quads` in the node view)."""

    host: str
    gpus: dict[str, Any] = Field(default_factory=dict)
    available: bool = True
    next_reservation: QuadsReservationView | None = None
    next_conflict_at: datetime | None = None
    conflict_within_lookahead: bool = False
    teardown_at: datetime | None = None
    """When the daemon tears a managed node on the host down: a reservation's start less the lookahead, or when it
    said so while the host is taken back within it (broken, retired, reserved); None: no teardown is due."""
    broken: bool = False
    """QUADS marks the host broken."""
    retired: bool = False
    """QUADS marks the host retired."""
    lookahead_s: float | None = None
    """The window, in seconds, within which a reservation takes the host back (`quads.lookahead_s`)."""
    data_age_s: float | None = None
    stale: bool = False
    last_error: str | None = None
    """Why the last read of QUADS failed; None after a good one."""

    def teardown_words(self, now: datetime) -> str:
        """When a managed node on the host is torn down, in words, the same in the console and the CLI:
        `torn down now: QUADS marks it broken`, `inside the lookahead: torn down now`, `torn down at 14:14 UTC`
        (with the date when it is not today's), or `no teardown due`.

        Args:
            now: the time of day (aware, UTC).
        """
        marks = " and ".join(word for word, on in (("broken", self.broken), ("retired", self.retired)) if on)
        if marks:
            return f"torn down now: QUADS marks it {marks}"
        at = self.teardown_at
        if at is None:
            return "no teardown due"
        if self.conflict_within_lookahead or at <= now:
            return "inside the lookahead: torn down now"
        at_utc = at.astimezone(now.tzinfo)
        when = f"{at_utc:%H:%M}" if at_utc.date() == now.date() else f"{at_utc:%Y-%m-%d %H:%M}"
        return f"torn down at {when} UTC"


class QuadsFreshness(_View):
    """How fresh the daemon's read of QUADS is (the top-level `quads` of `GET /admin/nodes`)."""

    fetched_at: datetime | None = None
    """When the last good read began (UTC); None before the first."""
    age_s: float | None = None
    """Its age in seconds when the daemon answered; None before the first."""
    stale: bool = True
    """True with no data, after a failed poll, or when the data is older than two poll intervals."""
    last_error: str | None = None
    """Why the last poll failed; None after a good one."""
    hosts: int = 0
    """The GPU hosts QUADS lends, nodes or not."""


class LentHosts(_View):
    """The GPU hosts QUADS lends that are not nodes (status `not_provisioned` in `GET /admin/nodes`), and how
    fresh the daemon's read of QUADS is."""

    hosts: list[QuadsView] = Field(default_factory=list)
    """Each host's QUADS view (its GPUs, next reservation and conflict), by name."""
    freshness: QuadsFreshness | None = None
    """None: the daemon does not read QUADS (no `[quads]`)."""


class NodeErrorView(_View):
    """One failure seen on a node (`recent_errors[]` of a node): a failed attempt of a request, whether or not
    another node then answered it, a stream the node broke off, or a failed health probe."""

    at: datetime
    """When it was last seen (UTC)."""
    first_at: datetime | None = None
    """When the first of `count` in a row was seen (UTC)."""
    status: int | None = None
    """The node's HTTP status (a 5xx answer); None for a transport error, a timeout or a probe."""
    error: str
    """What happened, as the daemon logs it (secrets redacted, control characters escaped)."""
    count: int = 1
    """Times it was seen in a row, up to `at`."""


class NodeInfo(_View):
    """A node as `GET /admin/nodes` shows it."""

    id: str
    endpoint: str
    status: str
    model: str
    engine: str
    artifact_id: str | None = None
    llamacpp_runtime: LlamaCppRuntime | None = None
    capabilities: NodeCapabilities = Field(default_factory=NodeCapabilities)
    managed: bool = False
    last_heartbeat: datetime | None = None
    source: str = ""
    in_flight: int = 0
    breaker: BreakerView = Field(default_factory=BreakerView)
    last_error: str | None = None
    last_error_at: datetime | None = None
    recent_errors: list[NodeErrorView] = Field(default_factory=list)
    """The node's last failures, newest first (at most 20; the same error in a row counts once)."""
    slots: SlotsView | None = None
    resident: list[ResidentModelView] | None = None
    """An Ollama node's loaded models (`GET /api/ps`); None for other engines or before the first reading."""
    health: HealthObservation = Field(default_factory=HealthObservation)
    quads: QuadsView | None = None
    """What QUADS says of the node's host; None without QUADS or for a host it does not lend."""
    gpus_live: LiveGpus | None = None
    """The node's live GPUs from `qiip agent` (None without a reading)."""


class NodeEvent(_View):
    """One change from `GET /admin/events`: `added`, `updated` or `removed`, with the node."""

    change: Literal["added", "updated", "removed"]
    node: NodeInfo


class OperationInfo(_View):
    """A background operation (drain, remove, relaunch)."""

    id: str
    kind: str
    node_id: str
    state: Literal["running", "succeeded", "failed", "cancelled"]
    result: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None
    log: list[dict[str, Any]] = Field(default_factory=list)


class HealthView(_View):
    """`GET /health`."""

    status: str
    nodes_registered: int = 0
    nodes_healthy: int = 0


class ChatDelta(_View):
    """A piece of a streamed chat answer: text, and the usage when the stream reports it.

    The first piece of a stream also names the node that answered (the daemon's `X-QIIP-Node` header,
    docs/api.md); later pieces, and answers from a daemon without the header, have `node` None.
    """

    content: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    node: str | None = None


def lent_only(item: Any) -> bool:
    """Whether an entry of `GET /admin/nodes` is a host QUADS lends that is not a node (no engine)."""
    return isinstance(item, dict) and item.get("engine") is None and item.get("source") == "quads"


def chat_delta(chunk: Mapping[str, Any]) -> ChatDelta:
    """The piece of a streamed chat completion one chunk carries (`choices[0].delta`, its `usage`)."""
    choices = chunk.get("choices") or []
    content, finish = "", None
    if choices:
        content = (choices[0].get("delta") or {}).get("content") or ""
        finish = choices[0].get("finish_reason")
    usage = chunk.get("usage") or {}
    return ChatDelta(content=content, finish_reason=finish, completion_tokens=usage.get("completion_tokens"))
