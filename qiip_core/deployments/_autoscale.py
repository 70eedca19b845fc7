"""Autoscaling: the replica count a deployment needs for its load, as a pure function of the metric over time.

```
autoscale(policy, state, metric=…, replicas=…, demand=…, now=…) -> AutoscaleStatus

  state          what the last step left in the status: recent samples, the up and down windows, the cooldown
  metric         the load measured now (`policy.metric`), over every serving process and gateway
  recommend      up:   ceil(replicas × metric / target), capped at max, once the metric stayed above target for
                       up_window_s and the cooldown passed (the count follows the load, as Kubernetes' HPA does)
                 down: one replica fewer, once the metric stayed below target × (1 − tolerance) for down_window_s
                       and the cooldown passed; never below min
                 zero: with min 0, no request for down_window_s releases the last replica; a request for a model at
                       zero replicas asks for one at once (scale from zero)
  desired        the recommendation in `active` mode; None otherwise (`recommend` only shows it)
```

The windows and the cooldown are kept in the stored status, so a restarted or newly elected controller continues
them instead of starting over (and never bursts into several decisions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from qiip_core.deployments._resource import AutoscaleStatus
from qiip_core.deployments._spec import Autoscale

__all__ = ["MAX_SAMPLES", "Demand", "autoscale", "metric_of"]

MAX_SAMPLES = 120
"""Samples of the metric kept in the status (at one per pass, four minutes at the default interval)."""


@dataclass(frozen=True)
class Demand:
    """What the gateways saw of a model's traffic, summed over every serving process and gateway."""

    in_flight: int = 0
    """Requests being answered now."""
    queued: int = 0
    """Requests waiting at the gateway: for a replica to start (scale from zero) or for admission."""
    slots: int = 0
    """llama.cpp slots over the model's ready replicas (0 when none report them)."""
    ttft_p90_s: float | None = None
    """The 90th percentile of time to first token over the recent window, in seconds; None without requests."""
    last_request_at: datetime | None = None
    """When the last request for the model arrived, if any did."""


def metric_of(policy: Autoscale, demand: Demand, replicas: int) -> float | None:
    """The value of `policy.metric` for `demand` over `replicas` ready replicas (None when it cannot be measured:
    no replica ready, or no request timed for TTFT). A per-slot metric whose replicas report no slots yet is
    counted per replica.

    Args:
        policy: the deployment's autoscale settings.
        demand: the measured demand.
        replicas: ready replicas.

    Returns:
        The metric.
    """
    if replicas == 0:
        return None  # nothing serves: the load cannot be read against capacity (scale from zero asks for one)
    if policy.metric == "queued":
        return float(demand.queued)
    if policy.metric == "ttft_p90_s":
        return demand.ttft_p90_s
    waiting = demand.in_flight + demand.queued
    if policy.metric == "in_flight_per_slot" and demand.slots > 0:
        return waiting / demand.slots
    return waiting / replicas  # per replica (vLLM; or llama.cpp replicas not reporting their slots yet)


def autoscale(
    policy: Autoscale,
    state: AutoscaleStatus,
    *,
    demand: Demand,
    replicas: int,
    ready: int,
    now: datetime,
) -> AutoscaleStatus:
    """One autoscaling step.

    Args:
        policy: the deployment's `autoscale` settings.
        state: what the last step stored.
        demand: the model's measured demand now.
        replicas: the replica count held now (desired; the starting point of a recommendation).
        ready: replicas serving now (what the metric is measured over).
        now: the current time (aware, UTC).

    Returns:
        The new state: samples, windows, the recommendation and its reason, and `desired` in active mode.
    """
    metric = metric_of(policy, demand, ready)
    samples = state.samples
    if metric is not None:
        samples = (*samples, (round(now.timestamp(), 3), round(metric, 4)))[-MAX_SAMPLES:]
    last_request = max(filter(None, (state.last_request_at, demand.last_request_at)), default=None)
    low = policy.target * (1 - policy.tolerance)
    above_since = (state.above_since or now) if metric is not None and metric > policy.target else None
    below_since = (state.below_since or now) if metric is not None and metric < low else None
    cooled = state.last_scale_at is None or now - state.last_scale_at >= timedelta(seconds=policy.cooldown_s)
    count, reason = replicas, "the metric is within its bounds"
    if policy.min == 0 and replicas == 0 and (demand.queued > 0 or demand.in_flight > 0):
        count, reason = 1, f"{demand.queued + demand.in_flight} request(s) wait for a model at zero replicas"
    elif metric is None:
        reason = (
            "replicas are starting: the load is measured once one serves"
            if replicas > 0 and ready == 0
            else "no measurement yet (no replica serves, or no request was timed)"
        )
    elif above_since is not None:
        wanted = min(policy.max, max(replicas + 1, math.ceil(max(replicas, 1) * metric / policy.target)))
        held = (now - above_since).total_seconds()
        if wanted <= replicas:
            reason = f"above target, but at max ({policy.max})"
        elif held < policy.up_window_s:
            reason = f"{policy.metric} {metric:.3g} above {policy.target:g} for {held:.0f} of {policy.up_window_s:g} s"
        elif not cooled:
            reason = f"above target; waiting for the cooldown ({policy.cooldown_s:g} s)"
        else:
            count, reason = wanted, f"{policy.metric} {metric:.3g} above {policy.target:g} for {held:.0f} s"
    elif below_since is not None:
        floor = policy.min
        idle = last_request is None or (now - last_request).total_seconds() >= policy.down_window_s
        if replicas == 1 and floor == 0 and not idle:
            floor = 1  # to zero only once no request came for the whole window
        held = (now - below_since).total_seconds()
        if replicas <= floor:
            reason = f"below target, at min ({policy.min})" + ("" if floor == policy.min else "; requests still come")
        elif held < policy.down_window_s:
            reason = f"{policy.metric} {metric:.3g} below {low:.3g} for {held:.0f} of {policy.down_window_s:g} s"
        elif not cooled:
            reason = f"below target; waiting for the cooldown ({policy.cooldown_s:g} s)"
        else:
            count, reason = replicas - 1, f"{policy.metric} {metric:.3g} below {low:.3g} for {held:.0f} s"
    count = max(policy.min, min(policy.max, count))
    changed = count != replicas
    active = policy.mode == "active"
    return AutoscaleStatus(
        desired=(count if active else None),
        recommendation=count if policy.mode != "off" else None,
        metric=metric,
        samples=samples,
        above_since=None if changed and active else above_since,
        below_since=None if changed and active else below_since,
        last_scale_at=now if changed and active else state.last_scale_at,
        last_request_at=last_request,
        reason=reason,
    )
