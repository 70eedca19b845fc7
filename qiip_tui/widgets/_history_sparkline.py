"""`HistorySparkline`: a sparkline with a fixed time axis.

Textual's `Sparkline` spreads whatever data it has over its whole width, so four samples after a restart fill
150 columns as wide as sixty do, and the same column means another time from one poll to the next. A
`HistorySparkline` gives each of its `capacity` samples the same share of the width, and draws the samples it has
at the right (the newest at the right edge), leaving the rest blank until the history fills.
"""

from __future__ import annotations

from rich.align import Align
from textual.app import RenderResult
from textual.renderables.sparkline import Sparkline as SparklineRenderable
from textual.widgets import Sparkline

__all__ = ["HistorySparkline", "drawn_columns"]


def drawn_columns(width: int, samples: int, capacity: int) -> int:
    """Columns the newest `samples` take in a sparkline `width` columns wide that holds `capacity` samples: the
    same share of the width each, at least one column when there is a sample."""
    samples = min(samples, capacity)
    return min(width, max(1, round(width * samples / capacity))) if samples else 0


class HistorySparkline(Sparkline):
    """A sparkline whose full width stands for `capacity` samples.

    Args:
        capacity: samples the width holds (a history's bound, such as `HISTORY_SAMPLES`).
        id: the widget's id.
    """

    def __init__(self, *, capacity: int, id: str | None = None) -> None:
        super().__init__([], id=id)
        self.capacity = max(1, capacity)

    def render(self) -> RenderResult:
        data = list(self.data or [])[-self.capacity :]
        width = self.size.width
        columns = drawn_columns(width, len(data), self.capacity)
        if not columns:
            return ""
        _, base = self.background_colors
        min_color = base + self.get_component_styles("sparkline--min-color").color
        max_color = base + self.get_component_styles("sparkline--max-color").color
        line = SparklineRenderable(
            data,
            width=columns,
            height=self.size.height,
            min_color=min_color.rich_color,
            max_color=max_color.rich_color,
            summary_function=self.summary_function,
        )
        return Align.right(line, width=width)
