"""Demand: what the gateways measure of each model's traffic, summed for the autoscaler.

```
DemandMeter                       one gateway's measurements that the routing table does not hold
  .finished(model, ttft_s)        a request ended (from the metrics of every serving process)
  .waiting(model) -> context      a request waits for a first replica (scale from zero): counted as queued
  .set_queued(source, counts)     a worker process's waiting requests, as it last reported them
  .snapshot(table) -> {model: Demand}
                                  in flight and slots from the routing table (its board counts every process),
                                  queued, TTFT p90 over the window and the last request from the meter
merge_demands(parts) -> {model: Demand}
                                  over gateways: in flight and queued add up (each gateway counts its own
                                  requests); slots are the largest (every gateway sees the same nodes); TTFT the
                                  worst p90; the latest request
DemandExchange                    publish this gateway's snapshot, read every gateway's
├── LocalDemandExchange           the embedded registry: one gateway, nothing to exchange
└── EtcdDemandExchange            <deployments_prefix>demand/<owner> under a lease of a few passes, so a gateway
                                  that stopped counts no more once its lease lapses
```

The autoscaler (`qiip_core.deployments.autoscale`) reads the merged `Demand` of each deployment's model; the
metric is never one process's view.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from qiip_core.deployments._autoscale import Demand
from qiip_core.nodes import NodeStatus
from qiip_core.storage import EtcdClient, unb64

if TYPE_CHECKING:
    from qiip_core.config import Settings
    from qiip_core.routing import RoutingTable

__all__ = [
    "DemandExchange",
    "DemandMeter",
    "EtcdDemandExchange",
    "LocalDemandExchange",
    "create_demand_exchange",
    "demand_from_json",
    "demand_to_json",
    "merge_demands",
]

logger = logging.getLogger("qiip.deployments")

TTFT_WINDOW_S = 120.0
"""Seconds of time-to-first-token samples the p90 is taken over."""

MAX_TTFT_SAMPLES = 1024
"""Samples kept per model at most (the newest), whatever the request rate: memory stays bounded."""

MAX_MODELS = 4096
"""Models the meter keeps measurements for at most; a model past it is not measured (client-chosen names of
unknown models never reach the meter: only requests a node answered or a deployment waits for are counted)."""


class DemandMeter:
    """One gateway's measurements of each model's traffic beyond what the routing table holds.

    Args:
        clock: the current time, in seconds since the epoch (tests give their own).
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._ttft: dict[str, deque[tuple[float, float]]] = {}
        self._last_request: dict[str, float] = {}
        self._queued: dict[str, int] = {}
        self._remote_queued: dict[str, Mapping[str, int]] = {}

    def finished(self, model: str, ttft_s: float | None) -> None:
        """Record a finished request of `model` (any serving process's): when, and its time to first token in
        seconds (streams), else None."""
        if not model or (model not in self._last_request and len(self._last_request) >= MAX_MODELS):
            return
        now = self._clock()
        self._last_request[model] = now
        if ttft_s is not None:
            samples = self._ttft.get(model)
            if samples is None:
                samples = self._ttft[model] = deque(maxlen=MAX_TTFT_SAMPLES)
            samples.append((now, ttft_s))

    @contextlib.contextmanager
    def waiting(self, model: str) -> Iterator[None]:
        """Count one request of `model` as queued while the `with` block runs (it waits for a first replica)."""
        self._queued[model] = self._queued.get(model, 0) + 1
        self._last_request[model] = self._clock()
        try:
            yield
        finally:
            left = self._queued[model] - 1
            if left:
                self._queued[model] = left
            else:
                del self._queued[model]

    def queued(self, model: str) -> int:
        """Requests of `model` waiting in this process now."""
        return self._queued.get(model, 0)

    def local_queued(self) -> dict[str, int]:
        """This process's waiting requests by model (what a worker reports to the primary)."""
        return dict(self._queued)

    def set_queued(self, source: str, counts: Mapping[str, int]) -> None:
        """Keep what another serving process (`source`, a worker) last reported waiting; an empty mapping (or a
        worker that exited) clears it."""
        if counts:
            self._remote_queued[source] = {str(m): int(n) for m, n in list(counts.items())[:MAX_MODELS]}
        else:
            self._remote_queued.pop(source, None)

    def snapshot(self, table: RoutingTable, models: Iterable[str]) -> dict[str, Demand]:
        """The demand of each of `models` as this gateway sees it now (every serving process of it).

        Args:
            table: the primary's routing table (in flight per node counts every process through the board).
            models: the models to measure (the deployments' names).

        Returns:
            `{model: Demand}`; `last_request_at` is now while a request is in flight or waiting.
        """
        now = self._clock()
        found: dict[str, Demand] = {}
        for model in models:
            in_flight = slots = 0
            for state in table.serving(model):
                in_flight += state.in_flight
                if state.status is NodeStatus.HEALTHY and state.slots is not None:
                    slots += state.slots[1]
            queued = self._queued.get(model, 0) + sum(c.get(model, 0) for c in self._remote_queued.values())
            last = now if in_flight or queued else self._last_request.get(model)
            found[model] = Demand(
                in_flight=in_flight,
                queued=queued,
                slots=slots,
                ttft_p90_s=self._ttft_p90(model, now),
                last_request_at=datetime.fromtimestamp(last, UTC) if last is not None else None,
            )
        return found

    def _ttft_p90(self, model: str, now: float) -> float | None:
        samples = self._ttft.get(model)
        if not samples:
            return None
        while samples and samples[0][0] < now - TTFT_WINDOW_S:
            samples.popleft()
        if not samples:
            return None
        ordered = sorted(value for _, value in samples)
        return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def merge_demands(parts: Iterable[Mapping[str, Demand]]) -> dict[str, Demand]:
    """Several gateways' demand as one (see the module's map).

    Args:
        parts: each gateway's `{model: Demand}`.

    Returns:
        `{model: Demand}` over all of them.
    """
    merged: dict[str, Demand] = {}
    for part in parts:
        for model, demand in part.items():
            seen = merged.get(model)
            if seen is None:
                merged[model] = demand
                continue
            ttfts = [t for t in (seen.ttft_p90_s, demand.ttft_p90_s) if t is not None]
            lasts = [t for t in (seen.last_request_at, demand.last_request_at) if t is not None]
            merged[model] = replace(
                seen,
                in_flight=seen.in_flight + demand.in_flight,
                queued=seen.queued + demand.queued,
                slots=max(seen.slots, demand.slots),
                ttft_p90_s=max(ttfts) if ttfts else None,
                last_request_at=max(lasts) if lasts else None,
            )
    return merged


def demand_to_json(demand: Demand) -> dict[str, Any]:
    """`demand` as a JSON object (for the exchange between gateways)."""
    return {
        "in_flight": demand.in_flight,
        "queued": demand.queued,
        "slots": demand.slots,
        "ttft_p90_s": demand.ttft_p90_s,
        "last_request_at": demand.last_request_at.isoformat() if demand.last_request_at is not None else None,
    }


def demand_from_json(data: Mapping[str, Any]) -> Demand:
    """The inverse of `demand_to_json`.

    Raises:
        ValueError, TypeError, KeyError: `data` is not such an object.
    """
    last = data.get("last_request_at")
    ttft = data.get("ttft_p90_s")
    return Demand(
        in_flight=max(0, int(data["in_flight"])),
        queued=max(0, int(data["queued"])),
        slots=max(0, int(data["slots"])),
        ttft_p90_s=float(ttft) if ttft is not None else None,
        last_request_at=datetime.fromisoformat(str(last)) if last is not None else None,
    )


class DemandExchange(ABC):
    """Where gateways share what they measure (see the module's map)."""

    @abstractmethod
    async def publish(self, demands: Mapping[str, Demand]) -> None:
        """Make this gateway's `{model: Demand}` visible to the others (replacing what it published before)."""

    @abstractmethod
    async def others(self) -> list[dict[str, Demand]]:
        """What the other gateways published and still hold a lease for (not this gateway's own)."""

    @abstractmethod
    async def aclose(self) -> None:
        """Withdraw this gateway's record and release the backend's connections."""


class LocalDemandExchange(DemandExchange):
    """The embedded registry: one gateway, nothing to share."""

    async def publish(self, demands: Mapping[str, Demand]) -> None:
        """Nothing to do: no other gateway reads it."""

    async def others(self) -> list[dict[str, Demand]]:
        """No other gateway."""
        return []

    async def aclose(self) -> None:
        """Nothing to release."""


class EtcdDemandExchange(DemandExchange):
    """`<etcd.deployments_prefix>demand/<owner>`: one JSON record per gateway under an etcd lease of `ttl_s`,
    refreshed at each publish.

    Args:
        settings: the daemon's settings (`etcd`).
        owner: this gateway's name (the key's last part).
        ttl_s: seconds a record outlives its gateway's last publish.
    """

    def __init__(self, settings: Settings, owner: str, *, ttl_s: int = 10) -> None:
        self.client = EtcdClient(settings.etcd)
        self.prefix = settings.etcd.deployments_prefix.encode() + b"demand/"
        self.key = self.prefix + owner.encode()
        self.ttl_s = ttl_s
        self.max_value_bytes = settings.etcd.max_value_bytes
        self._lease_id = 0

    def _publish(self, value: bytes) -> None:
        if self._lease_id and self.client.refresh(self._lease_id) > 0:
            self.client.put_with_lease(self.key, value, self._lease_id)
        else:
            self._lease_id = self.client.put(self.key, value, lease_ttl_s=self.ttl_s)

    async def publish(self, demands: Mapping[str, Demand]) -> None:
        """Write this gateway's record (a failure is logged: the next pass writes it again)."""
        value = json.dumps({m: demand_to_json(d) for m, d in demands.items()}, separators=(",", ":")).encode()
        if len(value) > self.max_value_bytes:
            logger.warning("the demand record is %d bytes, above etcd.max_value_bytes: not published", len(value))
            return
        try:
            await asyncio.to_thread(self._publish, value)
        except Exception as exc:  # RegistryUnavailable: etcd is down; the controller reads what it can
            logger.warning("the demand record could not be published: %s", getattr(exc, "message", exc))

    def _others(self) -> list[dict[str, Demand]]:
        _, kvs = self.client.range_prefix(self.prefix)
        found: list[dict[str, Demand]] = []
        for kv in kvs:
            if unb64(kv["key"]) == self.key:
                continue
            try:
                raw = unb64(kv.get("value", ""))
                if len(raw) > self.max_value_bytes:
                    raise ValueError("too large")
                data = json.loads(raw)
                found.append({str(m): demand_from_json(d) for m, d in data.items()})
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                key = unb64(kv["key"]).decode(errors="replace").encode("unicode_escape").decode()
                logger.warning("skipping the demand record %s: %s", key, exc)
        return found

    async def others(self) -> list[dict[str, Demand]]:
        """The other gateways' records (none when etcd cannot be read: the pass then sees this gateway only)."""
        try:
            return await asyncio.to_thread(self._others)
        except Exception as exc:  # RegistryUnavailable
            logger.warning("the other gateways' demand could not be read: %s", getattr(exc, "message", exc))
            return []

    async def aclose(self) -> None:
        """Delete this gateway's record and close the client."""
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.client.delete, self.key)
        await asyncio.to_thread(self.client.close)


def create_demand_exchange(settings: Settings, owner: str) -> DemandExchange:
    """The exchange of `registry.backend`: none for the embedded registry, etcd records for a fleet.

    Args:
        settings: the daemon's settings.
        owner: this gateway's name.
    """
    if settings.registry.backend == "etcd":
        ttl = max(5, math.ceil(settings.deployments.reconcile_interval_s * 4))
        return EtcdDemandExchange(settings, owner, ttl_s=ttl)
    return LocalDemandExchange()
