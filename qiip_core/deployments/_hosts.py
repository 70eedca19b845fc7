"""The host pool: the hosts deployments may use, and what QIIP knows of each.

A host enters the pool three ways: `[[hosts]]` in the configuration, `qiip host add` (stored in the registry's
backend, so every gateway sharing etcd sees it), and the GPU hosts QUADS lends (with `[quads]`). Each is
observed into a `HostView` the placement reads:

```
HostView
├── name, labels, origin              config | added | quads
├── gpus (+ gpus_from)                live (the host's `qiip agent`), declared (config or `host add`), quads
│                                     (QUADS' processor list: product and count, no memory), or none
├── memory_mib                        the host's RAM, declared: what a CPU-profile replica is planned against
├── quads                             the next reservation inside the deployment's window, or broken/retired
├── occupant                          the node on it (its deployment, if one owns it) or the operation running
├── engines, models                   what its last setup installed and served (a launch there skips the build)
└── failure                           the last failed setup on it, if any
```

Nothing here does I/O: the controller's observer gathers the inputs (`qiip_core.deployments.Observer`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any, Literal

from qiip_core.config import GpuSpec, HostSpec
from qiip_core.deployments._resource import HostChoice

__all__ = [
    "GpuSpec",
    "GpuView",
    "HostSpec",
    "HostGroups",
    "HostPool",
    "HostView",
    "Occupant",
    "QuadsWindow",
    "declared_gpus",
]


@dataclass(frozen=True)
class GpuView:
    """One GPU of a host as placement sees it."""

    index: int
    """Its index on the host (NVML order)."""
    product: str
    """The product name."""
    memory_total_mib: int | None
    """Total memory in MiB; None when only QUADS listed the GPU."""
    memory_free_mib: int | None = None
    """Free memory in MiB from a live reading (a declared GPU counts as empty)."""


@dataclass(frozen=True)
class QuadsWindow:
    """What QUADS says of a host over a deployment's window."""

    state: Literal["free", "reserved", "broken", "retired"]
    """`free` over the whole window; `reserved`: a schedule starts (or is in force) inside it; `broken` or
    `retired`: QUADS marks the host so."""
    conflict_at: datetime | None = None
    """When QUADS takes the host (now, for one in force); None when free."""
    describe: str = ""
    """Who takes it (`cloud02 (owner alice)`), for messages."""


@dataclass(frozen=True)
class Occupant:
    """What holds a host now, besides the deployment asking."""

    kind: Literal["node", "operation"]
    """A registered node, or a setup or teardown running on it."""
    describe: str
    """`node gpu01 serving 'chat' (healthy)`, `setup by gw1:8080 at nvidia_driver`."""
    deployment: str | None = None
    """The deployment that owns the node, if one does."""


@dataclass(frozen=True)
class HostView:
    """A host of the pool and what QIIP knows of it now (see the module's map)."""

    name: str
    """The host name."""
    origin: Literal["config", "added", "quads"]
    """Where it entered the pool."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Its labels (QUADS hosts carry `quads=true` and `gpu_product`)."""
    gpus: tuple[GpuView, ...] = ()
    """Its GPUs."""
    gpus_from: Literal["live", "declared", "quads", "none"] = "none"
    """Where `gpus` came from."""
    memory_mib: int | None = None
    """Its RAM in MiB, when declared."""
    quads: QuadsWindow | None = None
    """QUADS' word on the host, when QUADS knows it."""
    occupant: Occupant | None = None
    """What holds it now, if anything."""
    engines: frozenset[str] = frozenset()
    """Engines its last successful setup installed."""
    models: frozenset[str] = frozenset()
    """Models (paths in the shared cache, or repository ids) it served."""
    failure: str | None = None
    """The last failed operation on it, if the last one failed."""
    llmfit_score: float | None = None
    """llmfit's score (0–100) of the deployment's model on this host, when known."""

    def matches(self, patterns: tuple[str, ...]) -> bool:
        """Whether the host's name matches one of `patterns` (fnmatch; an empty tuple matches every host)."""
        return not patterns or any(fnmatch.fnmatchcase(self.name, p.lower()) for p in patterns)

    def view(self) -> dict[str, Any]:
        """The host as `/admin/hosts` shows it."""
        return {
            "name": self.name,
            "origin": self.origin,
            "labels": dict(self.labels),
            "gpus": [
                {
                    "index": g.index,
                    "product": g.product,
                    "memory_total_mib": g.memory_total_mib,
                    "memory_free_mib": g.memory_free_mib,
                }
                for g in self.gpus
            ],
            "gpus_from": self.gpus_from,
            "memory_mib": self.memory_mib,
            "quads": None
            if self.quads is None
            else {
                "state": self.quads.state,
                "conflict_at": self.quads.conflict_at.isoformat() if self.quads.conflict_at else None,
                "describe": self.quads.describe,
            },
            "occupant": None
            if self.occupant is None
            else {
                "kind": self.occupant.kind,
                "describe": self.occupant.describe,
                "deployment": self.occupant.deployment,
            },
            "engines": sorted(self.engines),
            "models": sorted(self.models),
            "failure": self.failure,
        }


def declared_gpus(spec: HostSpec) -> tuple[GpuView, ...]:
    """The GPUs `spec` declares, one `GpuView` each, indexed in declaration order."""
    views: list[GpuView] = []
    for gpu in spec.gpus:
        for _ in range(gpu.count):
            views.append(GpuView(len(views), gpu.product, gpu.memory_mib, gpu.memory_mib))
    return tuple(views)


@dataclass(frozen=True)
class HostGroups:
    """The hosts of a pool grouped by everything placement reads of a host but its name and what holds it, for one
    deployment's `placement.labels` keys and `placement.hosts` patterns (`HostPool.groups`).

    Hosts of one group are filtered, planned and scored alike by every deployment with those keys and patterns:
    `place` weighs a group once and explains each of its hosts with that answer. Positions are indexes into
    `HostPool.hosts` (name order).
    """

    of: tuple[int, ...]
    """The group of each host, by position."""
    first: tuple[int, ...]
    """The first host (lowest position) of each group, occupied or not: the one its answer is computed from."""
    free: tuple[tuple[int, ...], ...]
    """Each group's hosts without an occupant, in name order (an occupied host is explained on its own)."""


@dataclass(frozen=True)
class HostPool:
    """The pool as one pass sees it: every host in order, and by name (built once per pass, not per deployment).

    Hosts of one *shape* (the same GPUs, each with the same index, product, total and free memory, and the same
    RAM) are planned alike: placement proves a template's fit once per shape, not once per host.
    """

    hosts: tuple[HostView, ...]
    """Every host, by name."""
    by_name: Mapping[str, HostView]
    """The same hosts, by name."""
    shapes: tuple[int, ...] = ()
    """The shape number of each host of `hosts` (same position): equal numbers, equal `gpus` and `memory_mib`."""
    choices: dict[tuple[str, bool, tuple[str, ...], float | None, bool], HostChoice] = field(
        default_factory=dict, compare=False, repr=False
    )
    """The host choices `place` made over this pool, by their fields: deployments that weigh a host alike share
    one record (a pool is one pass, so nothing here outlives the observation it was made from)."""
    runs: dict[tuple[object, ...], tuple[tuple[HostChoice, ...], tuple[int, ...]]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """Runs of choices in name order with their hosts' positions: the free hosts (`HostGroups.free`) of one or
    more groups, each weighed alike, by grouping and each group's answer. Deployments that weigh the same groups
    alike share one run of records, and the work of ordering it."""
    _groups: dict[tuple[tuple[str, ...], tuple[str, ...]], HostGroups] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def of(cls, hosts: Sequence[HostView]) -> HostPool:
        """The pool of `hosts`."""
        ordered = tuple(sorted(hosts, key=lambda h: h.name))
        numbers: dict[tuple[tuple[GpuView, ...], int | None], int] = {}
        shapes = tuple(numbers.setdefault((h.gpus, h.memory_mib), len(numbers)) for h in ordered)
        return cls(hosts=ordered, by_name={h.name: h for h in ordered}, shapes=shapes)

    @cached_property
    def index(self) -> Mapping[str, int]:
        """Each host's position in `hosts`, by name."""
        return {h.name: i for i, h in enumerate(self.hosts)}

    @cached_property
    def occupied(self) -> frozenset[int]:
        """The positions of the hosts something holds now (`HostView.occupant`)."""
        return frozenset(i for i, h in enumerate(self.hosts) if h.occupant is not None)

    def groups(self, label_keys: tuple[str, ...], patterns: tuple[str, ...]) -> HostGroups:
        """The hosts grouped for a deployment whose `placement.labels` has `label_keys` and whose
        `placement.hosts` is `patterns`, made once per pool and keys.

        Two hosts share a group when they have the same shape (`gpus`, `memory_mib`), the same QUADS window,
        engines, models, llmfit score and origin, the same values at `label_keys`, and both match `patterns` or
        both do not: every field a filter or score reads but the host's name, occupant, and what this pass or
        this deployment did there (placed, holds, failed), which `place` reads host by host.

        Args:
            label_keys: the label keys the deployment's filters read.
            patterns: its host name patterns (empty: every host matches).

        Returns:
            The groups.
        """
        key = (label_keys, patterns)
        found = self._groups.get(key)
        if found is not None:
            return found
        numbers: dict[tuple[object, ...], int] = {}
        of: list[int] = []
        first: list[int] = []
        free: list[list[int]] = []
        occupied = self.occupied
        for position, h in enumerate(self.hosts):
            alike = (
                h.gpus,
                h.memory_mib,
                h.quads,
                h.engines,
                h.models,
                h.llmfit_score,
                h.origin,
                tuple(h.labels.get(k) for k in label_keys),
                h.matches(patterns),
            )
            group = numbers.setdefault(alike, len(numbers))
            if group == len(first):
                first.append(position)
                free.append([])
            of.append(group)
            if position not in occupied:
                free[group].append(position)
        found = self._groups[key] = HostGroups(of=tuple(of), first=tuple(first), free=tuple(map(tuple, free)))
        return found
