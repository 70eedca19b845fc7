"""The top of the node screen: who the node is, its state and its load, in two lines, and a third for a node whose
host QUADS lends."""

from __future__ import annotations

from datetime import datetime

from rich.text import Text
from textual.theme import Theme
from textual.widgets import Static

from qiip_core.client import NodeInfo
from qiip_tui._quads import quads_line
from qiip_tui._render import DASH, ENGINE_LABELS, Palette, breaker_text, plural, status_text

__all__ = ["NodeHeader"]


class NodeHeader(Static):
    """`gpu01  healthy  llama_cpp  Qwen/Qwen3-8B` and its endpoint, ownership, load and breaker; for a node whose
    host QUADS lends, the host's GPUs, its next reservation and the countdown to the node being taken back
    (`qiip_tui._quads.quads_line`).

    The owner calls `show()` with the node, or with None once it has left the fleet, and again as time passes
    (the countdown moves on).
    """

    DEFAULT_CSS = """
    NodeHeader {
        height: auto;
        padding: 0 1;
        background: $panel;
    }
    """

    def __init__(self, node_id: str, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=False)
        self.node_id = node_id
        self._palette = Palette()
        self._node: NodeInfo | None = None
        self._seen: datetime | None = None
        self._now: datetime | None = None

    def on_mount(self) -> None:
        self._palette = Palette.from_variables(self.app.theme_variables)
        self.app.theme_changed_signal.subscribe(self, self._theme_changed)

    def _theme_changed(self, theme: Theme) -> None:
        self._palette = Palette.from_variables(self.app.theme_variables)
        self.show(self._node, now=self._now)

    def show(self, node: NodeInfo | None, *, now: datetime | None = None) -> None:
        """Render the node (None: it is gone); `now`: the time of day (UTC) QUADS' countdown runs to (None: no
        QUADS line)."""
        self._node, self._now = node, now
        text = Text(self.node_id, style="bold")
        if node is None:
            text.append("  has left the fleet (removed)", style=self._palette.status("unknown"))
            self.update(text)
            return
        text.append("  ")
        text.append_text(status_text(node.status, self._palette))
        text.append(f"  {ENGINE_LABELS.get(node.engine, node.engine)}  {node.model}  in-flight {node.in_flight}")
        owner = f"managed ({node.source})" if node.managed else f"external ({node.source or 'registered'})"
        text.append(f"\n{node.endpoint} · {owner} · breaker ")
        text.append_text(breaker_text(node.breaker.state, self._palette))
        if node.breaker.consecutive_failures:
            text.append(f" ({plural(node.breaker.consecutive_failures, 'failure')})")
        # A registry update (a drain, an undrain) carries no heartbeat: the last one known still holds, and so
        # does the gateway's own last probe when it succeeded.
        probed = node.health.last_probe_at if node.health.consecutive_failures == 0 else None
        for seen in (node.last_heartbeat, probed):
            if seen is not None and (self._seen is None or seen > self._seen):
                self._seen = seen
        text.append(f" · seen {self._seen:%H:%M:%S} UTC" if self._seen is not None else f" · seen {DASH}")
        if node.quads is not None and now is not None:
            text.append("\n")
            text.append_text(quads_line(node.quads, now, self._palette, managed=node.managed))
        self.update(text)
