"""A node's traffic on the node screen: its rates now, and sparklines of the last minutes.

```
Req/s 12.3   Errors 0.4%   Retries/s 0.1   Tokens/s 842   TTFT p50 182ms p95 1.2s   Slots 3/4
Req/s    ▁▂▃▅▇█▇▅▃
Errors   ▁▁▁▁▁▅▁▁▁
Tokens/s ▂▃▄▆▇█▇▆▅
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline, Static

from qiip_tui._rates import HISTORY_SAMPLES, NodeRates
from qiip_tui._render import DASH, Palette, percent_text, rate_text, ttft_text
from qiip_tui.widgets._history_sparkline import HistorySparkline

__all__ = ["TrafficPanel"]

_SERIES: tuple[tuple[str, str, Callable[[NodeRates], float]], ...] = (
    ("rps", "Req/s", lambda r: r.requests_per_s),
    ("errors", "Errors", lambda r: (r.error_ratio or 0.0) * 100),
    ("tokens", "Tokens/s", lambda r: r.tokens_per_s),
)


class TrafficPanel(Vertical):
    """One node's rates (`qiip_tui._rates.NodeRates`) and their history. The owner calls `show()`."""

    DEFAULT_CSS = """
    TrafficPanel {
        height: auto;
        & #traffic-now { height: auto; }
        & Horizontal { height: 1; }
        & .traffic-label { width: 9; color: $foreground-muted; }
        & Sparkline { width: 1fr; }
        & Sparkline > .sparkline--max-color { color: $meter-used; }
        & Sparkline > .sparkline--min-color { color: $meter-used 30%; }
    }
    """

    def compose(self) -> ComposeResult:
        yield Static(DASH, id="traffic-now", markup=False)
        for key, label, _ in _SERIES:
            with Horizontal():
                yield Label(label, classes="traffic-label")
                yield HistorySparkline(capacity=HISTORY_SAMPLES, id=f"traffic-{key}")

    def show(
        self,
        rates: NodeRates | None,
        history: Sequence[NodeRates],
        *,
        slots: tuple[int, int | None],
        palette: Palette,
    ) -> None:
        """Show the node's latest rates and their history.

        Args:
            rates: the last interval's rates; None before two metrics polls.
            history: the readings so far, oldest first.
            slots: busy slots and slots (`qiip_tui._fleet.slots_of`; total None when unknown).
            palette: the theme's styles.
        """
        busy, total = slots
        text = Text()
        for label, value in (
            ("Req/s ", rate_text(rates.requests_per_s if rates else None)),
            ("Errors ", percent_text(rates.error_ratio if rates else None, palette)),
            ("Retries/s ", rate_text(rates.retries_per_s if rates else None)),
            ("Tokens/s ", rate_text(rates.tokens_per_s if rates else None)),
            ("TTFT p50 ", ttft_text(rates.ttft_p50_s if rates else None)),
            (" p95 ", ttft_text(rates.ttft_p95_s if rates else None)),
            ("Slots ", Text(f"{busy}/{total}" if total else f"{busy} in flight")),
        ):
            if text and not label.startswith(" "):
                text.append("   ")
            text.append(label, style="bold")
            text.append(value.plain, style=value.style)
        self.query_one("#traffic-now", Static).update(text)
        for key, _, read in _SERIES:
            data = [read(sample) for sample in history]
            # One reading has no trend; Sparkline would draw it as a full bar.
            self.query_one(f"#traffic-{key}", Sparkline).data = data if len(data) > 1 else []
