"""The control channel between the primary and its workers (`server.workers`): every message, written and read here.

One message is one line of JSON (`encode`, `decode`), an object whose `kind` names its record:

    primary → worker                            worker → primary
    NodePut, NodeDelete    a node changed       Hello     the worker's board row, once, first
    Expected               models on the way    Report    its finished requests, counters, waiting requests,
    Shared                 what others learned            and what it learned (every `_worker.FLUSH_S`;
    Ready                  the fleet was sent             an empty one is its heartbeat)
    TokensChanged          read the token store

The records are pydantic models: `decode` validates a whole line in one pass, in pydantic's compiled core, which
for the per-request rows of a `Report` is faster than `json.loads` followed by checks in Python. A line that is not
one of them (not JSON, an unknown `kind`, a field of the wrong shape) raises `ControlError`, and only that.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from qiip_core._errors import safe_text
from qiip_core._violation import first_violation
from qiip_core.nodes import Node
from qiip_core.routing import ExpectedModel
from qiip_proxy._metrics import CounterKey

__all__ = [
    "AccountedRow",
    "ControlError",
    "ControlMessage",
    "Expected",
    "Hello",
    "NodeDelete",
    "NodePut",
    "Ready",
    "Report",
    "Shared",
    "TokensChanged",
    "decode",
    "encode",
]

NonNegative: TypeAlias = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A duration in seconds or a counter's total: finite and not negative (one infinity would stay in a Prometheus sum
for good)."""

AccountedRow: TypeAlias = tuple[
    str,
    str,
    int,
    str | None,
    NonNegative,
    NonNegative | None,
    tuple[tuple[str, str], ...],
    str | None,
    tuple[int, int] | None,
]
"""One finished request as it travels: `_metrics.Accounted`'s fields in order (an `Accounted` is one;
`Accounted._make(row)` makes one of a row)."""


class ControlError(ValueError):
    """A line on the control channel that is not a message of this module (not JSON, an unknown `kind`, a field of
    the wrong shape), or a message its reader does not take; the message says which field and why."""


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Hello(_Message):
    """A worker's first line: which worker it is."""

    kind: Literal["hello"] = "hello"
    row: int = Field(ge=1)
    """The worker's row on the in-flight board (1 to `server.workers - 1`)."""


class NodePut(_Message):
    """A node the primary's routing table holds, as the worker's table must hold it."""

    kind: Literal["put"] = "put"
    node: Node
    """The registration with its effective status (`NodeState.effective_node`)."""
    source: str
    """Where the node came from (`NodeState.source`: a registry's name, `attached`)."""
    column: int | None
    """Its column on the in-flight board (None: none assigned)."""
    slots: tuple[int, int] | None
    """Its slots as last read (`NodeState.slots`: busy, total), None when unknown."""


class NodeDelete(_Message):
    """A node gone from the primary's routing table."""

    kind: Literal["delete"] = "delete"
    node_id: str


class Expected(_Message):
    """The models expected from nodes still starting (`RoutingTable.expected`), all of them."""

    kind: Literal["expected"] = "expected"
    models: dict[str, ExpectedModel]


class Shared(_Message):
    """What one serving process learned that the others must learn too (`_workers.take_shared`): both ways, from a
    worker inside its `Report`."""

    kind: Literal["shared"] = "shared"
    prefixes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """The prefixes routed, as (node id, block hashes) runs (`PrefixAffinity.take_recorded`)."""
    admin_auth_failed: tuple[str, ...] = ()
    """Client addresses whose admin credentials were refused."""
    client_auth_failed: tuple[str, ...] = ()
    """Client addresses whose invoke tokens were refused."""

    def __bool__(self) -> bool:
        return bool(self.prefixes or self.admin_auth_failed or self.client_auth_failed)

    @classmethod
    def joined(cls, parts: list[Shared]) -> Shared:
        """Every part's items in one message, in order."""
        if len(parts) == 1:
            return parts[0]
        return cls(
            prefixes=tuple(p for part in parts for p in part.prefixes),
            admin_auth_failed=tuple(p for part in parts for p in part.admin_auth_failed),
            client_auth_failed=tuple(p for part in parts for p in part.client_auth_failed),
        )


class Ready(_Message):
    """The whole fleet has been sent: the worker may serve."""

    kind: Literal["ready"] = "ready"


class TokensChanged(_Message):
    """An invoke token was created or revoked: read the token store now."""

    kind: Literal["tokens"] = "tokens"


class Report(_Message):
    """What a worker sends every `_worker.FLUSH_S`; one with nothing in it is its heartbeat."""

    kind: Literal["report"] = "report"
    requests: tuple[AccountedRow, ...] = ()
    """The requests it finished since its last report (`_metrics.Accounted`)."""
    counters: tuple[tuple[CounterKey, NonNegative], ...] | None = None
    """Every counter's total since the worker started (`GatewayMetrics.counted`), when one changed; else None."""
    queued: dict[str, int] | None = None
    """Its requests waiting for a deployment's first replica, by model, when that changed; else None."""
    shared: Shared | None = None
    """What it learned that the others must learn (None: nothing)."""


ControlMessage: TypeAlias = Hello | NodePut | NodeDelete | Expected | Shared | Ready | TokensChanged | Report
"""Any message of the control channel."""

_ADAPTER: TypeAdapter[ControlMessage] = TypeAdapter(Annotated[ControlMessage, Field(discriminator="kind")])


def encode(message: ControlMessage) -> bytes:
    """`message` as one line of the control channel (JSON, newline included)."""
    return message.__pydantic_serializer__.to_json(message) + b"\n"


def decode(line: bytes | str) -> ControlMessage:
    """The message on one line of the control channel (`encode`'s).

    Raises:
        ControlError: the line is not a message: not JSON, an unknown `kind`, or a field of the wrong shape (the
            error names the first such field).
    """
    try:
        return _ADAPTER.validate_json(line)
    except ValidationError as exc:
        first = first_violation(exc)
        where = first.field or "the line"
        raise ControlError(f"a malformed control message: {safe_text(where)}: {first.message}") from None
