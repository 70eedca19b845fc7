"""What the describe view (`d`) says of a node, as plain text an operator can read, search and paste, without a
terminal.

`describe_node` lays out the node's state first (what an operator looks at in an incident), then its recent
errors with their times and counts, the fleet journal's events about it, and last its whole record as the admin
API gives it (`GET /admin/nodes/{id}`), as JSON. `error_lines` is shared with the node screen's error list.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from qiip_core.client import NodeErrorView, NodeInfo
from qiip_tui._models import size_text
from qiip_tui._render import age_text, plural
from qiip_tui._types import LogRecord

__all__ = ["ShownError", "describe_node", "error_line", "node_errors", "resident_lines"]


@dataclass(frozen=True)
class ShownError:
    """One error as the console lists it."""

    at: datetime
    """When it was last seen (UTC)."""
    message: str
    """What it says."""
    count: int = 1
    """Times it was seen in a row."""
    first_at: datetime | None = None
    """When the first of `count` was seen."""


def _utc(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _error_text(error: NodeErrorView) -> str:
    status = f"HTTP {error.status}: " if error.status is not None and f"HTTP {error.status}" not in error.error else ""
    return status + error.error


def node_errors(node: NodeInfo | None, extra: Iterable[tuple[datetime, str]] = ()) -> list[ShownError]:
    """The node's recent errors (the daemon's record, `recent_errors`) and `extra` ones seen by the console (an
    operation it started that failed), newest first."""
    errors = [ShownError(at, message) for at, message in extra]
    if node is not None:
        errors += [ShownError(e.at, _error_text(e), e.count, e.first_at) for e in node.recent_errors]
    return sorted(errors, key=lambda error: error.at, reverse=True)


def error_line(error: ShownError, now: datetime) -> tuple[str, str]:
    """An error's time with its age and count (`12:03:04 (2m ago) ×3`), and its text."""
    at = error.at
    when = f"{at.astimezone(UTC):%H:%M:%S} ({age_text(at, now)})" + (f" ×{error.count}" if error.count > 1 else "")
    return when, error.message


def describe_node(
    node: NodeInfo,
    *,
    now: datetime,
    events: Sequence[LogRecord] | None,
    extra_errors: Iterable[tuple[datetime, str]] = (),
) -> str:
    """The describe view of `node`.

    Args:
        node: the node as the daemon last reported it.
        now: the time of day (UTC) ages are measured against.
        events: the fleet journal's rows about the node, oldest first; None when the daemon keeps no journal.
        extra_errors: errors the console saw besides the daemon's record (failed operations), with their times.

    Returns:
        The text, lines joined with newlines.
    """
    breaker = node.breaker
    health = node.health
    lines = [
        f"Name:         {node.id}",
        f"Status:       {node.status}",
        f"Model:        {node.model}",
        f"Engine:       {node.engine}",
        f"Endpoint:     {node.endpoint}",
        f"Source:       {node.source or '—'} ({'managed by this daemon' if node.managed else 'external'})",
        f"In flight:    {node.in_flight}" + (f" (slots {node.slots.busy}/{node.slots.total})" if node.slots else ""),
        f"Breaker:      {breaker.state.replace('_', '-')}"
        + (f" ({plural(breaker.consecutive_failures, 'consecutive failure')})" if breaker.consecutive_failures else ""),
        "Health:       "
        + ("observed" if health.observed else "not probed by this daemon yet")
        + (f", last probe {_utc(health.last_probe_at)}" if health.last_probe_at else "")
        + (f", {plural(health.consecutive_failures, 'failed probe')} in a row" if health.consecutive_failures else ""),
        f"Heard from:   {_utc(node.last_heartbeat) if node.last_heartbeat else '—'}",
    ]
    if node.artifact_id:
        lines.append(f"Artifact:     {node.artifact_id}")
    if node.resident is not None:
        loaded = resident_lines(node) or ["none"]
        lines += [f"{'Loaded:' if i == 0 else '':14}{line}" for i, line in enumerate(loaded)]
    if node.last_error:
        when = f"{_utc(node.last_error_at)} ({age_text(node.last_error_at, now)})" if node.last_error_at else "—"
        lines.append(f"Last error:   {when}: {node.last_error}")
    errors = node_errors(node, extra_errors)
    lines += ["", f"Recent errors ({len(errors)}, newest first):"]
    for error in errors:
        since = f", first {_utc(error.first_at)}" if error.first_at is not None else ""
        times = f" ×{error.count}{since}" if error.count > 1 else ""
        lines.append(f"  {_utc(error.at)} ({age_text(error.at, now)}){times}  {error.message}")
    if not errors:
        lines.append("  none")
    lines.append("")
    if events is None:
        lines.append("Events: this daemon keeps no journal (/admin/journal).")
    else:
        lines.append(f"Events ({len(events)}, from the fleet journal, oldest first):")
        for record in events:
            when = _utc(record.at) if record.at else "—"
            lines.append(f"  {when}  {record.tag or record.level:<14} {record.message}")
        if not events:
            lines.append("  none kept")
    as_json = json.dumps(node.model_dump(mode="json"), indent=2, sort_keys=True)
    lines += ["", f"Record (GET /admin/nodes/{node.id}):", *as_json.splitlines()]
    return "\n".join(lines)


def resident_lines(node: NodeInfo) -> list[str]:
    """An Ollama node's model as its server holds it in memory, as its last `GET /api/ps` said: one line
    (`llama3.2:3b  2.3 GiB, 1.9 GiB in GPU memory, context 8192`); empty when it is not loaded or the node is not an
    Ollama node."""
    lines = []
    for model in node.resident or []:
        where = (
            "all in GPU memory"
            if model.vram_bytes >= model.size_bytes
            else f"{size_text(model.vram_bytes)} in GPU memory"
        )
        context = f", context {model.context_length}" if model.context_length else ""
        lines.append(f"{model.name}  {size_text(model.size_bytes)}, {where}{context}")
    return lines
