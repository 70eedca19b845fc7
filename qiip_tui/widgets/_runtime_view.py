"""A llama.cpp node's runtime record, requested against effective, one setting per row; then the model's
architecture, each cache the server allocated, and any check the verifier could not make."""

from __future__ import annotations

from typing import Any

from qiip_core.nodes import LlamaCppRuntime
from qiip_tui._render import DASH
from qiip_tui.widgets._console_table import ConsoleTable

__all__ = ["RuntimeView"]

_ROWS: tuple[tuple[str, str | None, str | None], ...] = (
    ("sizing", "sizing", None),
    ("fit target (MiB)", "fit_target_mib", None),
    ("context per slot", "context_per_slot", "context_per_slot"),
    ("slots", "slots", "slots"),
    ("aggregate context", None, "aggregate_context"),
    ("training context", None, "train_context"),
    ("cache type K", "cache_type", "cache_type_k"),
    ("cache type V", "cache_type", "cache_type_v"),
    ("flash attention", None, "flash_attn"),
    ("layers on GPU", None, "gpu_layers"),
    ("device mode", None, "device_mode"),
    ("estimator overrun", "allow_estimator_overrun", "estimator_overrun_used"),
)
"""Label, `requested` key and `effective` key of each row."""

_CACHE_LABELS = {"kv": "K/V cache", "kv_swa": "K/V cache (window)", "recurrent": "recurrent state"}
"""How each cache kind of `llamacpp_runtime.memory` is labelled."""


def _show(value: Any) -> str:
    if value is None:
        return DASH
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


class RuntimeView(ConsoleTable[str]):
    """`llamacpp_runtime`: what was asked (`requested`) and what the server runs (`effective`)."""

    DEFAULT_CSS = """
    RuntimeView {
        height: auto;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="none", show_cursor=False, zebra_stripes=True)

    def on_mount(self) -> None:
        self.add_column("setting", key="setting")
        self.add_column("requested", key="requested")
        self.add_column("effective", key="effective")

    def show(self, runtime: LlamaCppRuntime | None) -> None:
        """Show a record; None says the node has none (not llama.cpp, or a failed relaunch)."""
        self.clear()
        if runtime is None:
            self.add_row("no runtime record", DASH, DASH)
            return
        requested, effective = runtime.requested, runtime.effective
        for label, want, got in _ROWS:
            value = effective.get(got) if got else None
            if got == "gpu_layers" and value is not None:
                value = f"{value} of {effective.get('total_layers', '?')}"
            self.add_row(label, _show(requested.get(want) if want else None), _show(value) if got else DASH)
        offload = effective.get("layer_offload")
        if offload:
            self.add_row("layer offload", DASH, str(offload))
        if runtime.architecture:
            self.add_row("architecture", DASH, runtime.architecture)
        for cache in runtime.memory:
            label = _CACHE_LABELS.get(str(cache.get("kind")), str(cache.get("kind")))
            types = (
                cache.get("type_k")
                if cache.get("type_k") == cache.get("type_v")
                else (f"{cache.get('type_k')}/{cache.get('type_v')}")
            )
            self.add_row(
                label,
                DASH,
                f"{_show(cache.get('cells'))} cells × {_show(cache.get('layers'))} layers, {types}, "
                f"{float(cache.get('mib') or 0):,.2f} MiB",
            )
        for item in runtime.unverified:
            # The check's name; the node screen shows the whole sentence, wrapped, under the table.
            self.add_row("not verified", DASH, item.split(":", 1)[0])
        self.add_row("observed", DASH, runtime.observed_at.strftime("%Y-%m-%d %H:%MZ"))
