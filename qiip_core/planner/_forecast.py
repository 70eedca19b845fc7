"""Forecast other sizings of a running llama.cpp server from its runtime record, without the model file.

The sizing editor has no GGUF to read, only the node's `llamacpp_runtime`: the caches the server allocated
(`memory`, each with its kind, cells, types and MiB, matched against the plan when it started) and the memory
each device has left (`gpus`, after load). The weights and the compute buffer stay what they are for another
sizing of the same model; the caches scale:

```
kv          cells = ceil256(context × slots); bytes per cell × element size of the new type / the old one
kv_swa      cells grow with the slots (the window is per sequence), at most the aggregate; same type rule
recurrent   one cell per slot; its state is F32 whatever the K/V type
```

So `free after = free now + caches now − caches then`, per device (with several GPUs the caches are spread
evenly over them: the record does not say how the layers are split). A candidate fits when every device keeps
`fit_target_mib + 4` MiB free, the rule of `plan`. The automatic policy's pick is `plan`'s own search
(`auto_search`) run on this rule: F16 first, Q8_0 only if F16 cannot fit one slot at the floor.

This is a forecast, not a plan: the compute buffer grows a little with the slots, and the node plans for
itself when it relaunches (docs/planner.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qiip_core.planner._plan import auto_search
from qiip_core.planner._shape import row_bytes
from qiip_core.planner._types import FIT_SLACK_MIB, MAX_AGGREGATE_CONTEXT, CacheType, DeviceMemory, ceil_step

__all__ = ["RecordedServer", "SizingForecast"]

_CACHE_TYPES: tuple[CacheType, ...] = ("f16", "q8_0")


@dataclass(frozen=True, kw_only=True)
class SizingForecast:
    """What one sizing would hold, forecast from a running server's record."""

    context_per_slot: int
    """Tokens every slot is guaranteed."""
    slots: int
    """Parallel sequences."""
    cache_type: CacheType
    """K and V cache type."""
    aggregate_context: int
    """K/V cells: `ceil256(context_per_slot × slots)`."""
    kv_mib: float
    """Every cache together (K/V, sliding window, recurrent state), in MiB."""
    free_after_mib: tuple[float, ...]
    """Memory left free on each device with this sizing, in MiB, in device order."""
    fits: bool
    """Every device keeps `fit_target_mib + 4` MiB free (and the aggregate is one llama.cpp can take)."""


def _element_ratio(new: str, old: str) -> float:
    # Bytes per element of a row of 32 (a whole Q8_0 block): 2 for F16, 34/32 for Q8_0.
    return row_bytes(new, 32) / row_bytes(old, 32)


@dataclass(frozen=True)
class RecordedServer:
    """A running server as its runtime record describes it.

    Build it with `from_record`.
    """

    train_context: int
    """The model's training context in tokens."""
    slots: int
    """The server's slots now."""
    caches: tuple[Mapping[str, Any], ...]
    """`llamacpp_runtime.memory`: `{kind, cells, type_k, mib}` per cache."""
    devices: tuple[DeviceMemory, ...]
    """The devices, with their free memory after the server loaded."""

    @classmethod
    def from_record(
        cls, effective: Mapping[str, Any], memory: Sequence[Mapping[str, Any]], devices: Sequence[DeviceMemory]
    ) -> RecordedServer | None:
        """Read a runtime record (`llamacpp_runtime.effective`, `.memory`, and the devices from `.gpus`).

        Returns:
            The server, or None when the record cannot support a forecast: no training context or slots, no
            device, or no cache with its cells and MiB (an architecture whose caches are not modelled).
        """
        train, slots = effective.get("train_context"), effective.get("slots")
        if not isinstance(train, int) or not isinstance(slots, int) or train <= 0 or slots <= 0 or not devices:
            return None
        caches = tuple(
            cache
            for cache in memory
            if isinstance(cache.get("cells"), int)
            and cache["cells"] > 0
            and isinstance(cache.get("mib"), int | float)
            and str(cache.get("type_k")) in ("f16", "q8_0", "f32")
        )
        if not caches or len(caches) != len(memory):
            return None
        return cls(train, slots, caches, tuple(devices))

    @property
    def kv_mib_now(self) -> float:
        """Every cache of the running server, in MiB."""
        return sum(float(cache["mib"]) for cache in self.caches)

    def kv_mib(self, context_per_slot: int, slots: int, cache_type: CacheType) -> float:
        """Every cache a sizing would allocate, in MiB (the module docstring's scaling rules)."""
        aggregate = ceil_step(context_per_slot * slots)
        total = 0.0
        for cache in self.caches:
            kind, cells, mib = cache.get("kind"), int(cache["cells"]), float(cache["mib"])
            if kind == "recurrent":
                total += mib * slots / self.slots
                continue
            new_cells = aggregate if kind == "kv" else min(aggregate, cells * slots / self.slots)
            total += mib * new_cells / cells * _element_ratio(cache_type, str(cache["type_k"]))
        return total

    def forecast(
        self, context_per_slot: int, slots: int, cache_type: CacheType, *, fit_target_mib: int
    ) -> SizingForecast:
        """What a sizing would hold and leave free.

        Args:
            context_per_slot: tokens per slot, > 0.
            slots: parallel sequences, > 0.
            cache_type: K and V cache type.
            fit_target_mib: MiB to keep free on every device.

        Returns:
            The forecast.
        """
        aggregate = ceil_step(context_per_slot * slots)
        kv = self.kv_mib(context_per_slot, slots, cache_type)
        share = (self.kv_mib_now - kv) / len(self.devices)
        free = tuple(device.free_mib + share for device in self.devices)
        fits = aggregate <= MAX_AGGREGATE_CONTEXT and all(f >= fit_target_mib + FIT_SLACK_MIB for f in free)
        return SizingForecast(
            context_per_slot=context_per_slot,
            slots=slots,
            cache_type=cache_type,
            aggregate_context=aggregate,
            kv_mib=kv,
            free_after_mib=free,
            fits=fits,
        )

    def automatic(self, *, fit_target_mib: int) -> SizingForecast | None:
        """What the automatic policy would pick on these devices now.

        Args:
            fit_target_mib: MiB to keep free on every device.

        Returns:
            The pick, or None when not even one slot at the floor fits with Q8_0.
        """

        def fits(context: int, slots: int, cache_type: CacheType) -> bool:
            return self.forecast(context, slots, cache_type, fit_target_mib=fit_target_mib).fits

        for cache_type in _CACHE_TYPES:
            found = auto_search(self.train_context, fits, cache_type)
            if found is not None:
                return self.forecast(*found, cache_type, fit_target_mib=fit_target_mib)
        return None
