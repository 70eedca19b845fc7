"""`TargetSparkline`: a metric's recent values against the value it should be held at.

An autoscaler's question is "above or below target, and for how long", which a plain sparkline cannot answer: it
scales to its own minimum and maximum, so a flat line at twice the target looks the same as one at half of it.
Here the vertical scale always includes the target, which is drawn as a dotted rule across the columns the bars do
not reach, and each bar is in the warning colour when its value is above the target. One column per sample, the
newest at the right edge.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.text import Text
from textual.app import RenderResult
from textual.reactive import reactive
from textual.widget import Widget

__all__ = ["TargetSparkline", "target_bars"]

_EIGHTHS = " ▁▂▃▄▅▆▇█"
_RULE = "┄"


def target_bars(values: Sequence[float], target: float, *, width: int, height: int) -> list[list[tuple[str, str]]]:
    """The sparkline's cells, top row first: `(character, kind)` with kind `above` (a bar above the target),
    `below` (a bar at or below it), `target` (the target's rule) or `` (blank).

    The scale runs from 0 to the larger of the highest value and 1.5 × the target, so the target sits at two
    thirds of the height or lower. Only the newest `width` values are drawn, right-aligned.

    Args:
        values: the samples, oldest first.
        target: the value the metric is held at (> 0).
        width, height: the size in cells.
    """
    if width <= 0 or height <= 0:
        return []
    shown = list(values)[-width:]
    top = max([*shown, target * 1.5]) or 1.0
    rule_row = min(height - 1, int(target / top * height))  # counted from the bottom
    columns: list[list[tuple[str, str]]] = []
    for index in range(width):
        offset = index - (width - len(shown))
        value = shown[offset] if offset >= 0 else None
        column = []
        for row in range(height):
            if value is None:
                eighths = 0
            else:
                eighths = max(0, min(8, round(value / top * height * 8) - row * 8))
                if row == 0 and value > 0:
                    eighths = max(1, eighths)  # a value above zero is never invisible
            if eighths:
                column.append((_EIGHTHS[eighths], "above" if value is not None and value > target else "below"))
            elif row == rule_row:
                column.append((_RULE, "target"))
            else:
                column.append((" ", ""))
        columns.append(column)
    return [[columns[x][row] for x in range(width)] for row in reversed(range(height))]


class TargetSparkline(Widget):
    """A metric's samples (`values`) against `target`; nothing is drawn while `target` is None."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "target-sparkline--above",
        "target-sparkline--below",
        "target-sparkline--target",
    }
    """
    | Class | Description |
    | :- | :- |
    | `target-sparkline--above` | A bar above the target. |
    | `target-sparkline--below` | A bar at or below the target. |
    | `target-sparkline--target` | The target's rule. |
    """

    DEFAULT_CSS = """
    TargetSparkline {
        height: 3;
        & > .target-sparkline--above { color: $warning; }
        & > .target-sparkline--below { color: $success; }
        & > .target-sparkline--target { color: $foreground-muted; }
    }
    """

    values: reactive[tuple[float, ...]] = reactive(())
    """The samples, oldest first."""
    target: reactive[float | None] = reactive(None)
    """The value the metric is held at; None draws nothing."""

    def render(self) -> RenderResult:
        if self.target is None or self.target <= 0:
            return ""
        styles = {
            kind: self.get_component_rich_style(f"target-sparkline--{kind}") for kind in ("above", "below", "target")
        }
        text = Text(no_wrap=True)
        rows = target_bars(self.values, self.target, width=self.size.width, height=self.size.height)
        for number, row in enumerate(rows):
            if number:
                text.append("\n")
            for character, kind in row:
                text.append(character, style=styles.get(kind, ""))
        return text
