"""The settings of load shedding (`[admission]`): how many requests for one model the gateway keeps in flight,
and how it refuses the next one.

A request is in flight from the moment it is sent to a node (its reservation) until its answer ends. Past the
bound the gateway answers at once, before anything else is sent, instead of queuing the request behind the
others: a client told "retry in 1 s" can go elsewhere or back off, one whose request waits in a queue that grows
without bound cannot. The bound is per model, absolute (`max_in_flight`) and/or derived from the slots the
model's llama.cpp nodes report (`queue_per_slot`); both off by default, so an upgrade never starts refusing
traffic that was served before.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from qiip_core.config._groups import _Group

__all__ = ["AdmissionSettings", "ModelAdmission"]


class ModelAdmission(_Group):
    """One model's bound (`[admission.models."NAME"]`); a field left out takes the `[admission]` default."""

    max_in_flight: int | None = Field(default=None, ge=1, le=1_000_000)
    """Requests for this model in flight at the gateway at once; the next one is shed."""
    queue_per_slot: float | None = Field(default=None, ge=0, le=10_000)
    """Requests that may wait per llama.cpp slot beyond those being served: the bound is
    `slots × (1 + queue_per_slot)`, over the slots of the model's healthy nodes (`GET /slots`)."""


class AdmissionSettings(_Group):
    """Load shedding per model (`[admission]`). Off unless a bound is set."""

    max_in_flight: int | None = Field(default=None, ge=1, le=1_000_000)
    """Requests for one model in flight at the gateway at once, for every model without its own; the next one is
    shed. None (the default): no absolute bound."""
    queue_per_slot: float | None = Field(default=None, ge=0, le=10_000)
    """Requests that may wait per slot beyond those being served, for models whose nodes report their slots
    (llama-server's `GET /slots`): the bound is `slots × (1 + queue_per_slot)`, rounded up, and follows the
    fleet as nodes come and go. 0 sheds as soon as every slot is busy. A model with no node reporting slots (vLLM,
    attached servers) has no derived bound. None (the default): off. With both bounds set, the lower one holds."""
    status: Literal[429, 503] = 429
    """The status of a shed request: 429 (Too Many Requests, the default: the `openai` library raises
    `RateLimitError` and, with its retries on, waits `Retry-After` before trying again) or 503 (Service
    Unavailable, for clients and load balancers that fail over on 503 only)."""
    retry_after_s: int = Field(default=1, ge=1, le=3600)
    """The `Retry-After` of a shed request, in whole seconds."""
    models: dict[str, ModelAdmission] = Field(default_factory=dict)
    """Bounds of single models, by model name, overriding the defaults above field by field."""

    @model_validator(mode="after")
    def _named_models(self) -> AdmissionSettings:
        for name in self.models:
            if not name:
                raise ValueError("admission.models has an entry with an empty model name; name the model it bounds")
        return self

    def for_model(self, model: str) -> tuple[int | None, float | None]:
        """The bounds that hold for `model`: its own where set, else the defaults.

        Args:
            model: the model name, as clients send it.

        Returns:
            `(max_in_flight, queue_per_slot)`, each None when off.
        """
        own = self.models.get(model)
        if own is None:
            return self.max_in_flight, self.queue_per_slot
        return (
            own.max_in_flight if own.max_in_flight is not None else self.max_in_flight,
            own.queue_per_slot if own.queue_per_slot is not None else self.queue_per_slot,
        )

    @property
    def enabled(self) -> bool:
        """True when any bound is set, for any model."""
        return (
            self.max_in_flight is not None
            or self.queue_per_slot is not None
            or any(m.max_in_flight is not None or m.queue_per_slot is not None for m in self.models.values())
        )
