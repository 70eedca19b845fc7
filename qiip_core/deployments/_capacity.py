"""Capacity planning: how many replicas, on which hosts of the pool, a deployment needs for a stated load, before
anything is applied (`qiip deploy plan`).

```
plan_capacity(deployment, hosts, load=…, decode=…, fit=…, given=…) -> CapacityPlan

  seconds per request    answer_tokens / decode tokens/s of one sequence (measured on the running fleet's
                         replicas of the model, or stated)
  sequences              requests/s × seconds per request / target   (Little's law, with the autoscaler's
                                                                      target share of slots busy: 0.8 by default)
  replicas               the pool's eligible hosts in placement order, each replica adding the slots the planner
                         gives it there, until the sequences are covered
```

Every host the placement refuses is listed with its reasons (`place`'s explain); a load the whole pool cannot carry
says how many slots are missing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from qiip_core.deployments._hosts import HostView
from qiip_core.deployments._placement import FitCheck, PlacementInput, host_devices, place
from qiip_core.deployments._resource import Deployment

__all__ = ["CapacityPlan", "Decode", "Load", "PlannedReplica", "plan_capacity"]


@dataclass(frozen=True)
class Load:
    """The load a deployment must carry."""

    requests_per_s: float
    """Requests arriving per second, on average."""
    prompt_tokens: int
    """Tokens of a typical prompt."""
    answer_tokens: int
    """Tokens of a typical answer."""


@dataclass(frozen=True)
class Decode:
    """How fast one sequence is answered: tokens of answer per second, and where the figure comes from."""

    tokens_per_s: float
    """Answer tokens per second of one sequence (time to the last token over tokens generated, prompt included)."""
    source: str
    """`measured over N requests of the running fleet` or `stated`."""


@dataclass(frozen=True)
class PlannedReplica:
    """One replica the plan would place."""

    host: str
    slots: int
    """Sequences it serves at once there (the planner's slots)."""
    context_per_slot: int
    """Tokens of context per slot (0: unknown, vLLM)."""


@dataclass(frozen=True)
class CapacityPlan:
    """The answer of `plan_capacity` (see the module's map)."""

    load: Load
    decode: Decode
    target: float
    """Share of slots the plan keeps busy (the autoscaler's `in_flight_per_slot` target, else 0.8)."""
    seconds_per_request: float
    sequences: float
    """Sequences in flight the load needs, with the target's headroom."""
    replicas: list[PlannedReplica]
    """The replicas to place, in placement order (as many as cover `sequences`, or the whole pool)."""
    refused: dict[str, list[str]] = field(default_factory=dict)
    """Hosts the placement refuses, with why."""
    shortfall: str | None = None
    """What is missing when the pool cannot carry the load; None when it can."""
    warnings: list[str] = field(default_factory=list)
    """What the operator should know (a request longer than a slot's context, …)."""

    @property
    def slots(self) -> int:
        """Slots over the planned replicas."""
        return sum(r.slots for r in self.replicas)


def plan_capacity(
    deployment: Deployment,
    hosts: Sequence[HostView],
    *,
    load: Load,
    decode: Decode,
    fit: FitCheck,
    given: PlacementInput,
    quads_free_for_s: float,
) -> CapacityPlan:
    """Plan the replicas `deployment` needs for `load` on `hosts` (see the module's map).

    Args:
        deployment: the deployment (its template resolved), applied or not.
        hosts: the pool as the controller sees it.
        load: the stated load.
        decode: one sequence's answer speed.
        fit: the planner's check of the template on a host's devices.
        given: the placement's input (time, profile; nothing to avoid for a plan).
        quads_free_for_s: QUADS' window, for the explain's wording.

    Returns:
        The plan. Raises nothing: what cannot be planned is said in `refused`, `shortfall` and `warnings`.
    """
    policy = deployment.spec.autoscale
    target = policy.target if policy.mode != "off" and policy.metric == "in_flight_per_slot" else 0.8
    target = min(target, 1.0)
    seconds = load.answer_tokens / decode.tokens_per_s
    sequences = load.requests_per_s * seconds / target
    chosen, explain = place(
        deployment, hosts, wanted=len(hosts), given=given, fit=fit, quads_free_for_s=quads_free_for_s
    )
    refused = {c.host: list(c.reasons) for c in explain.hosts if not c.eligible}
    by_name = {h.name: h for h in hosts}
    replicas: list[PlannedReplica] = []
    warnings: list[str] = []
    for name in chosen:
        if sum(r.slots for r in replicas) >= sequences and replicas:
            break
        devices = host_devices(by_name[name], cpu_profile=given.cpu_profile)
        result = fit(deployment.template, devices) if not isinstance(devices, str) else None
        slots = max(1, result.slots) if result is not None else 1
        context = result.context_per_slot if result is not None else 0
        replicas.append(PlannedReplica(host=name, slots=slots, context_per_slot=context))
    needed_context = load.prompt_tokens + load.answer_tokens
    short = sorted({r.context_per_slot for r in replicas if 0 < r.context_per_slot < needed_context})
    if short:
        warnings.append(
            f"a request of {needed_context:,} tokens (prompt and answer) does not fit a slot of {short[0]:,} tokens: "
            "size the runtime for longer contexts (runtime.capacity.context_tokens)"
        )
    have = sum(r.slots for r in replicas)
    shortfall = None
    if have < sequences:
        missing = math.ceil(sequences - have)
        shortfall = (
            f"the pool's {len(chosen)} eligible host(s) give {have} slot(s); the load needs {math.ceil(sequences)}: "
            f"{missing} slot(s) more (more hosts, or a smaller sizing)"
        )
    return CapacityPlan(
        load=load,
        decode=decode,
        target=target,
        seconds_per_request=seconds,
        sequences=sequences,
        replicas=replicas,
        refused=refused,
        shortfall=shortfall,
        warnings=warnings,
    )
