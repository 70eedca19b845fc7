"""Admission: shed a request before it is sent to a node, when its model already has as many requests in flight
at the gateway as `[admission]` allows.

Without a bound, every request is taken and waits: at the node for a free slot, and in the gateway's own event
loop, whose latency then grows with every request added (docs/performance.md). With one, the request past the
bound is answered at once with 429 (or 503) and `Retry-After`, before anything else is sent, so a stream is
refused with a status line, not cut.

A model's requests in flight are its nodes' reservations (`NodeState.in_flight`), counted when the check runs:
nothing is kept here that could drift from the table. The check and the first reservation run in one step of
the event loop (`Forwarder.open` reserves before its first await), so concurrent requests never overshoot the
bound. Failover attempts of an admitted request are not checked again.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from qiip_core._errors import ModelOverloaded
from qiip_core.nodes import NodeStatus

if TYPE_CHECKING:
    from qiip_core.config import AdmissionSettings
    from qiip_core.routing._table import RoutingTable

__all__ = ["Admission", "AdmissionBound"]

logger = logging.getLogger("qiip.routing")


class AdmissionBound:
    """The bound in force for one model now.

    Attributes:
        limit: requests in flight admitted at once.
        reason: which setting gives it: `max_in_flight` or `queue_per_slot`.
        slots: the model's slots over its healthy nodes, when a derived bound was computed; else None.
    """

    __slots__ = ("limit", "reason", "slots")

    def __init__(self, limit: int, reason: str, slots: int | None = None) -> None:
        self.limit = limit
        self.reason = reason
        self.slots = slots


class Admission:
    """The per-model bound on requests in flight at the gateway (`[admission]`).

    Args:
        table: the routing table, whose reservations are the requests in flight.
        settings: the bounds, the status and `Retry-After` of a shed request.
    """

    def __init__(self, table: RoutingTable, settings: AdmissionSettings) -> None:
        self.table = table
        self.settings = settings
        self.enabled = settings.enabled
        """False when no bound is set for any model: `admit` then does nothing."""

    def bound(self, model: str) -> AdmissionBound | None:
        """The bound for `model` now: the lower of its absolute bound and its derived one.

        The derived bound is `slots × (1 + queue_per_slot)`, rounded up, over the slots the model's healthy
        llama.cpp nodes last reported; a model whose nodes report none has no derived bound.

        Args:
            model: the model, as clients name it.

        Returns:
            The bound, or None when the model has none.
        """
        max_in_flight, queue_per_slot = self.settings.for_model(model)
        found = AdmissionBound(max_in_flight, "max_in_flight") if max_in_flight is not None else None
        if queue_per_slot is not None:
            slots = sum(
                state.slots[1]
                for state in self.table.serving(model)
                if state.slots is not None and state.status is NodeStatus.HEALTHY
            )
            if slots > 0:
                derived = max(1, math.ceil(slots * (1 + queue_per_slot)))
                if found is None or derived < found.limit:
                    found = AdmissionBound(derived, "queue_per_slot", slots)
        return found

    def in_flight(self, model: str) -> int:
        """Requests for `model` in flight at the gateway: the reservations on its nodes."""
        return sum(state.in_flight for state in self.table.serving(model))

    def admit(self, model: str) -> None:
        """Let a new request for `model` through, or shed it.

        Args:
            model: the requested model.

        Raises:
            ModelOverloaded: the model has as many requests in flight as its bound allows; the error carries
                the status (`admission.status`), `Retry-After` (`admission.retry_after_s`) and the bound's
                `reason`.
        """
        if not self.enabled:
            return
        bound = self.bound(model)
        if bound is None:
            return
        in_flight = self.in_flight(model)
        if in_flight < bound.limit:
            return
        if bound.reason == "queue_per_slot":
            why = f"{bound.slots} slots, admission.queue_per_slot = {self.settings.for_model(model)[1]:g}"
        else:
            why = "admission.max_in_flight"
        seconds = self.settings.retry_after_s
        raise ModelOverloaded(
            f"The model {model!r} is overloaded: {in_flight} requests are in flight, the most this gateway "
            f"admits ({bound.limit}: {why}); retry in {seconds} s.",
            model=model,
            status=self.settings.status,
            reason=bound.reason,
            retry_after_s=seconds,
        )
