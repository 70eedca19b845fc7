"""The cells of the fleet table's rows, as Rich `Text`: what each column shows for a node.

Pure: no Textual. `RowCells` remembers what each row was rendered from, so a row whose node did not change (a
metrics poll: new rates for every busy node, the same nodes) renders its four rate cells only, and a node whose
live GPU reading alone is new (`qiip agent`, every second) its GPU cell.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from rich.text import Text

from qiip_core.client import NodeInfo
from qiip_tui._fleet import FLEET_COLUMNS, gpu_totals, on_cpu, slots_of
from qiip_tui._rates import NodeRates
from qiip_tui._render import (
    Palette,
    breaker_text,
    engine_text,
    error_text,
    gpu_text,
    percent_text,
    rate_text,
    slots_text,
    status_text,
    ttft_text,
)

__all__ = ["COLUMN_KEYS", "ERROR_CELL", "RowCells", "same_cell"]

COLUMN_KEYS = [column.key for column in FLEET_COLUMNS]
"""The columns' keys, left to right."""

ERROR_CELL = len(COLUMN_KEYS) - 1
"""The index of the last-error cell, whose age moves on with time."""

_RPS, _ERRORS, _RETRIES, _TTFT, _GPU = (COLUMN_KEYS.index(key) for key in ("rps", "errors", "retries", "ttft", "gpu"))
_GPU_WIDTH = FLEET_COLUMNS[COLUMN_KEYS.index("gpu")].max_width
_ENGINE_WIDTH = FLEET_COLUMNS[COLUMN_KEYS.index("engine")].max_width


def same_cell(before: Text, after: Text) -> bool:
    """Whether two cells look the same. Text's own == compares the characters and spans, not the style of the
    whole Text, which is how the status and breaker colours are given: a theme change must count as a change."""
    return before == after and before.style == after.style


def _same_but_live(before: NodeInfo, after: NodeInfo) -> bool:
    """Whether two readings of a node differ at most in their live GPUs (`gpus_live`, new at every reading of
    `qiip agent`): field by field, without copying either."""
    old, new = before.__dict__, after.__dict__
    return old.keys() == new.keys() and all(value == new[key] for key, value in old.items() if key != "gpus_live")


def _recovered(node: NodeInfo) -> bool:
    return node.status == "healthy" and node.breaker.state == "closed"


class RowCells:
    """Renders rows, remembering what each was rendered from."""

    def __init__(self) -> None:
        self.palette = Palette()
        """The theme's styles; set it, then `forget()`, when the theme changes."""
        self._sources: dict[str, tuple[NodeInfo, NodeRates | None]] = {}

    def forget(self, node_id: str | None = None) -> None:
        """Forget what one row (or, without an id, every row) was rendered from: it renders whole next time."""
        if node_id is None:
            self._sources.clear()
        else:
            self._sources.pop(node_id, None)

    def render(
        self, node: NodeInfo, rates: NodeRates | None, now: datetime, old: list[Text] | None = None
    ) -> list[Text]:
        """The row's cells, one per `FLEET_COLUMNS` column.

        Args:
            node: the node.
            rates: its rates (`Fleet.rates.nodes`), None before two metrics polls.
            now: the time of day, for the last error's age.
            old: the cells the row shows; when `node` is the one they were rendered from, only the rate cells are
                rendered again (and `old` itself comes back when the rates are the same too); when it differs from
                that one in its live GPUs only, the GPU cell too.
        """
        palette = self.palette
        source = self._sources.get(node.id)
        self._sources[node.id] = (node, rates)
        if old is not None and source is not None and (source[0] is node or _same_but_live(source[0], node)):
            if source[0] is node and source[1] is rates:
                return old
            cells = list(old)
            if source[1] is not rates:
                cells[_RPS] = rate_text(rates.requests_per_s if rates else None)
                cells[_ERRORS] = percent_text(rates.error_ratio if rates else None, palette)
                cells[_RETRIES] = rate_text(rates.retries_per_s if rates else None)
                cells[_TTFT] = ttft_text(rates.ttft_p50_s if rates else None)
            if source[0] is not node:
                cells[_GPU] = gpu_text(_GPU_WIDTH, palette, gpu_totals(node), ram=on_cpu(node))
            return cells
        return [
            Text(node.id),
            status_text(node.status, palette),
            Text(node.model),
            rate_text(rates.requests_per_s if rates else None),
            percent_text(rates.error_ratio if rates else None, palette),
            rate_text(rates.retries_per_s if rates else None),
            slots_text(*slots_of(node)),
            ttft_text(rates.ttft_p50_s if rates else None),
            breaker_text(node.breaker.state, palette),
            gpu_text(_GPU_WIDTH, palette, gpu_totals(node), ram=on_cpu(node)),
            engine_text(node.engine, _ENGINE_WIDTH),
            self.error(node, now),
        ]

    def error(self, node: NodeInfo, now: datetime) -> Text:
        """The last-error cell: its age, dimmed once the node has recovered."""
        return error_text(node.last_error, node.last_error_at, now, current=not _recovered(node), palette=self.palette)

    def aged(self, rows: Mapping[str, list[Text]], nodes: Mapping[str, NodeInfo], now: datetime) -> list[str]:
        """Re-render the last-error cells of `rows` whose text changed with time (their age), in place.

        Returns:
            The ids of the rows changed.
        """
        changed = []
        for node_id, cells in rows.items():
            node = nodes.get(node_id)
            if node is None or not node.last_error or node.last_error_at is None:
                continue
            after = self.error(node, now)
            if not same_cell(cells[ERROR_CELL], after):
                cells[ERROR_CELL] = after
                changed.append(node_id)
        return changed
