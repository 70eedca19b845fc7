"""One device's memory: a bar of used over total, a sparkline of its recent history, the figures, and under them
the device's utilisation, temperature and power where the node reports them."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, ProgressBar, Sparkline

from qiip_tui._render import format_mib
from qiip_tui.widgets._history_sparkline import HistorySparkline

__all__ = ["GpuMeter"]


class GpuMeter(Vertical):
    """A device's memory use. The owner calls `show()` with each new reading and the history so far.

    Args:
        label: what to call the device (`GPU 0`, `CPU (system memory)`).
        capacity: the readings the history sparkline's width stands for (a fixed time axis).
    """

    DEFAULT_CSS = """
    GpuMeter {
        height: auto;
        & > Horizontal { height: 1; }
        & .gpu-label { width: 6; color: $foreground-muted; }
        & ProgressBar { width: 1fr; }
        & ProgressBar > Horizontal { width: 1fr; }
        & Bar { width: 1fr; }
        & Bar > .bar--bar, & Bar > .bar--complete { color: $meter-used; background: $meter-free; }
        & .gpu-figures { width: auto; min-width: 15; content-align-horizontal: right; }
        & .gpu-detail { margin-left: 6; color: $foreground-muted; }
        & Sparkline { width: 1fr; margin-left: 6; }
        & Sparkline > .sparkline--max-color { color: $meter-used; }
        & Sparkline > .sparkline--min-color { color: $meter-used 30%; }
    }
    """

    def __init__(self, label: str, *, capacity: int = 60, id: str | None = None) -> None:
        super().__init__(id=id)
        self.label = label
        self.capacity = capacity
        self._reading: tuple[int, int, list[float], int | None, str] | None = None

    def compose(self) -> ComposeResult:
        with Horizontal():
            yield Label(self.label, classes="gpu-label")
            yield ProgressBar(total=1, show_eta=False, show_percentage=True)
        with Horizontal():
            yield HistorySparkline(capacity=self.capacity)
            yield Label("", classes="gpu-figures")
        yield Label("", classes="gpu-detail")

    def on_mount(self) -> None:
        self._apply()

    def show(
        self,
        used_mib: int,
        total_mib: int,
        history_mib: Sequence[float],
        *,
        utilization_pct: int | None = None,
        detail: str = "",
    ) -> None:
        """Show a reading.

        Args:
            used_mib: memory in use now, in MiB.
            total_mib: the device's memory, in MiB.
            history_mib: the readings taken while the screen was open, oldest first, in MiB.
            utilization_pct: the device's compute utilisation, in percent, when the node reports it.
            detail: more of the live reading, after the figures (`61°C · 250 W`).
        """
        self._reading = (used_mib, total_mib, list(history_mib), utilization_pct, detail)
        if self.is_mounted:
            self._apply()

    def _apply(self) -> None:
        if self._reading is None:
            return
        used_mib, total_mib, history, utilization, detail = self._reading
        self.query_one(ProgressBar).update(total=max(total_mib, 1), progress=used_mib)
        self.query_one(".gpu-figures", Label).update(f"{format_mib(used_mib)} / {format_mib(total_mib)}")
        # Utilisation, temperature and power on a line of their own, so a narrow panel does not cut them.
        more = ([f"{utilization}%"] if utilization is not None else []) + ([detail] if detail else [])
        line = self.query_one(".gpu-detail", Label)
        line.update(" · ".join(more))
        line.display = bool(more)
        # One reading has no trend; Sparkline would draw it as a full bar.
        self.query_one(Sparkline).data = history if len(history) > 1 else []
