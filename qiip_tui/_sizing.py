"""The sizing editor's form: its values, the policy they make, the core's verdict, and an arithmetic preview.

Pure. The rules are the core's (`qiip_core.planner.validate_policy`, which the daemon runs on a relaunch too);
this module only turns what the operator typed into a policy, hands it over, and previews what the policy
implies (`ceil256(context × slots)` and how the K/V cache compares with the running server's), with the core's
forecast from the runtime record (`qiip_core.planner.RecordedServer`): the K/V cache in MiB, the memory left
free on each device, and what the automatic policy would pick now.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal

from qiip_core.client import NodeInfo
from qiip_core.nodes import LlamaCppRuntime
from qiip_core.planner import (
    CONTEXT_FLOOR,
    CONTEXT_STEP,
    MAX_AGGREGATE_CONTEXT,
    DeviceMemory,
    RecordedServer,
    SizingForecast,
    Violation,
    bytes_per_element,
    validate_policy,
)
from qiip_tui._fleet import devices_of, training_context

__all__ = ["SizingValues", "check_sizing", "forecast_lines", "sizing_preview"]

Sizing = Literal["auto", "custom"]


_WHOLE_NUMBER = re.compile(r"-?(?:[0-9]{1,3}(?:([,_])[0-9]{3}(?:\1[0-9]{3})*)?|[0-9]+)")


def _number(text: str) -> int | str:
    # Digits, optionally grouped by thousands with one separator (32,768 or 32_768). Anything else goes to
    # the core as typed, so its message quotes it.
    stripped = text.strip()
    if _WHOLE_NUMBER.fullmatch(stripped):
        return int(stripped.replace("_", "").replace(",", ""))
    return text


@dataclass(frozen=True)
class SizingValues:
    """What the form holds, as typed."""

    sizing: Sizing = "auto"
    """`auto` or `custom`."""
    fit_target_mib: str = "512"
    """MiB to leave free on every device."""
    context_per_slot: str = ""
    """Tokens per slot (custom)."""
    slots: str = ""
    """Parallel sequences (custom)."""
    cache_type: str = "f16"
    """`f16` or `q8_0` (custom)."""

    @classmethod
    def from_runtime(cls, runtime: LlamaCppRuntime) -> SizingValues:
        """The node's requested policy; custom fields start at what the server runs now."""
        requested, effective = runtime.requested, runtime.effective
        sizing: Sizing = "custom" if requested.get("sizing") == "custom" else "auto"

        def pick(key: str, fallback: Any) -> str:
            value = requested.get(key, effective.get(key, fallback))
            return "" if value is None else str(value)

        return cls(
            sizing=sizing,
            fit_target_mib=pick("fit_target_mib", 512),
            context_per_slot=pick("context_per_slot", None),
            slots=pick("slots", None),
            cache_type=str(requested.get("cache_type") or effective.get("cache_type_k") or "f16"),
        )

    def with_value(self, field: str, value: str) -> SizingValues:
        """A copy with one field changed."""
        changes: dict[str, Any] = {field: value}
        return replace(self, **changes)

    def policy(self) -> dict[str, Any]:
        """The relaunch body: `{"sizing": "auto", "fit_target_mib"}` or the custom fields too."""
        policy: dict[str, Any] = {"sizing": self.sizing, "fit_target_mib": _number(self.fit_target_mib)}
        if self.sizing == "custom":
            policy["context_per_slot"] = _number(self.context_per_slot)
            policy["slots"] = _number(self.slots)
            policy["cache_type"] = self.cache_type
        return policy


def check_sizing(values: SizingValues, node: NodeInfo) -> list[Violation]:
    """Every rule the form's policy breaks on this node (`qiip_core.planner.validate_policy`)."""
    train = training_context(node) or MAX_AGGREGATE_CONTEXT
    return validate_policy(values.policy(), train_context=train, devices=devices_of(node))


def _ceil_step(tokens: int) -> int:
    return -(-tokens // CONTEXT_STEP) * CONTEXT_STEP


def sizing_preview(values: SizingValues, runtime: LlamaCppRuntime | None) -> list[str]:
    """Lines previewing what the form's policy implies.

    Returns:
        For a custom policy with whole numbers: the aggregate context and how the K/V cache compares with the
        running server's; for an automatic one, what the planner will do.
    """
    effective = runtime.effective if runtime is not None else {}
    if values.sizing == "auto":
        train = effective.get("train_context")
        floor = min(CONTEXT_FLOOR, train) if isinstance(train, int) else CONTEXT_FLOOR
        return [
            f"The planner picks the longest context per slot it can guarantee (at least {floor:,} tokens), "
            "then the most slots, F16 before Q8_0,",
            f"leaving {values.fit_target_mib.strip() or '?'} MiB free on every device.",
        ]
    context, slots = _number(values.context_per_slot), _number(values.slots)
    if not isinstance(context, int) or not isinstance(slots, int) or context <= 0 or slots <= 0:
        return ["Aggregate context: enter a context per slot and a number of slots."]
    aggregate = _ceil_step(context * slots)
    lines = [f"Aggregate context: ceil256({context:,} × {slots}) = {aggregate:,} tokens"]
    if aggregate > MAX_AGGREGATE_CONTEXT:
        return [*lines, f"llama.cpp's largest context is {MAX_AGGREGATE_CONTEXT:,} tokens: no K/V cache to compare."]
    current, current_type = effective.get("aggregate_context"), effective.get("cache_type_k")
    new_bytes = bytes_per_element(values.cache_type)
    old_bytes = bytes_per_element(str(current_type))
    if isinstance(current, int) and current > 0 and new_bytes and old_bytes:
        ratio = aggregate * new_bytes / (current * old_bytes)
        kinds = {str(cache.get("kind")) for cache in runtime.memory} if runtime is not None else set()
        if kinds - {"kv"}:
            # A sliding window's cache grows with the slots, recurrent state with the slots only: the ratio is
            # the full-attention cache's alone.
            lines.append(
                f"Full-attention K/V cache ≈ {ratio:.2f}× the running server's ({aggregate:,} {values.cache_type} "
                f"cells vs {current:,} {current_type}); its window or recurrent cache grows with the slots only"
            )
        else:
            lines.append(
                f"K/V cache ≈ {ratio:.2f}× the running server's ({aggregate:,} {values.cache_type} cells "
                f"vs {current:,} {current_type})"
            )
    return lines


def _free_text(devices: list[DeviceMemory], forecast: SizingForecast) -> str:
    return ", ".join(
        f"{'CPU' if device.kind == 'cpu' else f'GPU {device.index}'} {free:,.0f} MiB"
        for device, free in zip(devices, forecast.free_after_mib, strict=True)
    )


def forecast_lines(values: SizingValues, node: NodeInfo) -> list[str]:
    """Lines forecasting the form's sizing on the node, from its runtime record (`RecordedServer`).

    Returns:
        For a custom sizing with whole numbers: its K/V cache in MiB against the running server's, and the
        memory left free on each device; then what the automatic policy would pick now, with the same two
        figures. One line saying why when the record cannot support a forecast.
    """
    runtime, devices = node.llamacpp_runtime, devices_of(node)
    server = RecordedServer.from_record(runtime.effective, runtime.memory, devices) if runtime is not None else None
    if server is None:
        return ["K/V size and free memory: unknown (this node's record lists no caches to scale)."]
    target = _number(values.fit_target_mib)
    if not isinstance(target, int) or target < 0:
        return ["K/V size and free memory: enter a free VRAM target first."]
    lines = []
    context, slots = _number(values.context_per_slot), _number(values.slots)
    if (
        values.sizing == "custom"
        and isinstance(context, int)
        and isinstance(slots, int)
        and context > 0
        and slots > 0
        and values.cache_type in ("f16", "q8_0")
    ):
        cache_type: Any = values.cache_type
        custom = server.forecast(context, slots, cache_type, fit_target_mib=target)
        lines.append(f"K/V cache: {custom.kv_mib:,.1f} MiB (running now: {server.kv_mib_now:,.1f} MiB)")
        lines.append(
            f"Free after: {_free_text(devices, custom)}"
            + ("" if custom.fits else f", under the {target:,} MiB target: the relaunch would be refused")
        )
    auto = server.automatic(fit_target_mib=target)
    if auto is None:
        lines.append(f"Automatic would find no sizing that leaves {target:,} MiB free.")
    else:
        lines.append(
            f"Automatic would pick: {auto.slots} slot{'s' if auto.slots != 1 else ''} × "
            f"{auto.context_per_slot:,} tokens, {auto.cache_type} (K/V {auto.kv_mib:,.1f} MiB; free after: "
            f"{_free_text(devices, auto)})"
        )
    return lines
