"""Rich text for cells and lines whose colour depends on a value (a node's status, a log level, a meter).

The short cells (rates, percentages, TTFT, slots) are shared `Text` objects, one per label: copy one
(`Text.copy()`) before changing it.

Textual resolves `$variables` in CSS, but a DataTable cell or a log line is a Rich `Text` built in Python. The
`Palette` turns the current theme's variables (`App.theme_variables`) into Rich styles, so these colours come
from the theme too; widgets rebuild it when `App.theme_changed_signal` fires.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache

from rich.console import JustifyMethod
from rich.style import Style
from rich.text import Text
from textual.color import Color, ColorParseError

from qiip_core.nodes import Engine
from qiip_tui._themes import CONSOLE_VARIABLES

__all__ = [
    "DASH",
    "ENGINE_LABELS",
    "Palette",
    "breaker_text",
    "engine_text",
    "format_mib",
    "gpu_text",
    "plural",
    "age_text",
    "error_text",
    "meter_text",
    "percent_text",
    "rate_text",
    "slots_text",
    "status_text",
    "ttft_text",
]

DASH = "—"
"""Shown for a value the daemon does not report."""

_BAR_FULL, _BAR_EMPTY = "█", "░"


@dataclass(frozen=True)
class Palette:
    """Rich styles for the console's theme variables (`CONSOLE_VARIABLES`)."""

    styles: Mapping[str, Style] = field(default_factory=dict)
    """Style by variable name; a missing one renders unstyled."""

    @classmethod
    def from_variables(cls, variables: Mapping[str, str]) -> Palette:
        """Resolve the variables, blending translucent colours over the theme's background."""
        background = _parse(variables.get("background", "")) or Color(0, 0, 0)
        styles = {}
        for name in CONSOLE_VARIABLES:
            colour = _parse(variables.get(name, ""))
            if colour is not None:
                styles[name] = Style(color=(background + colour).rich_color)
        return cls(styles)

    def style(self, name: str) -> Style:
        """The style of variable `name` (without the `$`)."""
        return self.styles.get(name, Style())

    def status(self, status: str) -> Style:
        """The style of a node status: `$status-<status>` with `_` as `-`."""
        return self.style("status-" + status.replace("_", "-"))


@lru_cache(maxsize=4096)
def _cell(label: str, justify: JustifyMethod | None = None, style: Style | None = None) -> Text:
    # A metrics poll renders four cells of every row, mostly the same few labels (`0`, `—`, `0%`, `1.2`): one
    # shared Text per label and style. Shared, so never modified: callers copy before changing one.
    return Text(label, style=style or "", justify=justify)


def _parse(value: str) -> Color | None:
    try:
        return Color.parse(value) if value else None
    except ColorParseError:
        return None


def status_text(status: str, palette: Palette) -> Text:
    """A node status, in its colour."""
    return Text(status, style=palette.status(status))


def breaker_text(state: str, palette: Palette) -> Text:
    """A circuit breaker state (`closed`, `open`, `half_open`) in its colour."""
    return Text(state.replace("_", "-"), style=palette.style("breaker-" + state.replace("_", "-")))


def format_mib(mib: float) -> str:
    """A memory size: `950M` below 10 GiB shows MiB, above shows GiB with one decimal."""
    return f"{mib:.0f}M" if mib < 10 * 1024 else f"{mib / 1024:.1f}G"


def meter_text(used: float, total: float, width: int, palette: Palette) -> Text:
    """A bar of `width` cells, filled in the share `used / total`."""
    share = min(max(used / total, 0.0), 1.0) if total > 0 else 0.0
    filled = round(share * width)
    # Styles go on the spans, not the Text: a Text's own style would colour what callers append too.
    text = Text()
    text.append(_BAR_FULL * filled, style=palette.style("meter-used"))
    text.append(_BAR_EMPTY * (width - filled), style=palette.style("meter-free"))
    return text


def _gib(mib: float) -> str:
    gib = mib / 1024
    return f"{gib:.1f}" if gib < 10 else f"{gib:.0f}"


def gpu_text(width: int, palette: Palette, totals: tuple[int, int] | None, *, ram: bool = False) -> Text:
    """The fleet table's memory cell: a bar and `used/total` in GiB (`RAM` before the figures when the node runs on
    the CPU, where the memory is the host's), or a dash when the node reports no devices."""
    if totals is None:
        return Text(DASH)
    used, total = totals
    figures = f"{_gib(used)}/{_gib(total)}G"
    label = (f"RAM {figures}" if ram else figures).rjust(9)
    bar_width = max(width - len(label), 3)
    return meter_text(used, total, bar_width, palette).append(label)


ENGINE_LABELS = {engine.value: engine.label for engine in Engine}
"""How engines are named on screen."""


def engine_text(engine: str, width: int) -> Text:
    """An engine's name, shortened to `width` cells (`llama.cpp` becomes `llama`)."""
    label = ENGINE_LABELS.get(engine, engine)
    return Text(label if len(label) <= width else label.split(".")[0][:width])


def ttft_text(ttft_s: float | None) -> Text:
    """A time to first token, `123ms` or `1.2s`; a dash when unknown."""
    if ttft_s is None:
        return _cell(DASH)
    return _cell(f"{ttft_s * 1000:.0f}ms" if ttft_s < 1 else f"{ttft_s:.1f}s")


def rate_text(per_s: float | None) -> Text:
    """A rate per second, right-aligned: `0`, `0.4`, `12.3`, `1.2k`; a dash when unknown."""
    if per_s is None:
        return _cell(DASH, "right")
    if per_s == 0:
        label = "0"
    elif per_s < 100:
        label = f"{per_s:.1f}"
    elif per_s < 1000:
        label = f"{per_s:.0f}"
    else:
        label = f"{per_s / 1000:.1f}k"
    return _cell(label, "right")


def percent_text(ratio: float | None, palette: Palette) -> Text:
    """A share (0..1) as a percentage, in the error colour when above zero; a dash when unknown."""
    if ratio is None:
        return _cell(DASH, "right")
    if ratio == 0:
        return _cell("0%", "right")
    label = f"{ratio * 100:.1f}%" if ratio < 0.1 else f"{ratio * 100:.0f}%"
    return _cell(label, "right", palette.status("unhealthy"))


def slots_text(busy: int, total: int | None) -> Text:
    """Busy slots of the node's slots (`3/4`), or the requests in flight when it has no slot count."""
    return _cell(f"{busy}/{total}" if total else str(busy), "right")


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """`count` and the noun, singular for one: `1 failure`, `3 failures` (`nouns`: an irregular plural)."""
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"


def age_text(at: datetime, now: datetime) -> str:
    """How long ago `at` was, in its largest unit: `now`, `42s ago`, `3m ago`, `5h ago`, `2d ago`."""
    seconds = max((now - at).total_seconds(), 0.0)
    if seconds < 1:
        return "now"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def error_text(error: str | None, at: datetime | None, now: datetime, *, current: bool, palette: Palette) -> Text:
    """A node's last error: its age, then its first line; dimmed when the node has recovered since
    (`current` False), in the error colour while it is current; a dash when there is none."""
    if not error:
        return Text(DASH)
    first = error.splitlines()[0]
    # One line, cut with an ellipsis where the column ends (the describe view, `d`, has it all).
    text = Text(f"{age_text(at, now)} · {first}" if at is not None else first, no_wrap=True, overflow="ellipsis")
    text.stylize(palette.status("unhealthy") if current else "dim")
    return text
