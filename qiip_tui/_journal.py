"""What the logs screen shows of the fleet journal and of engine logs, without a terminal.

The daemon's journal entry (`GET /admin/journal`: `{seq, at, node, event, summary, reason, …}`) and engine-log event
(`{"event": "line" | "reset", …}`) are plain JSON here; these functions turn them into the log view's `LogRecord`s:
a timeline row reads `time  node  event  summary — reason`, its event in the colour of what it means (the status a
node turned to, an operation's outcome), from the theme's palette.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from datetime import datetime
from typing import Any

from qiip_tui._types import LogRecord

__all__ = ["EVENT_LABELS", "engine_record", "engine_records", "journal_record", "journal_records"]

EVENT_LABELS: dict[str, str] = {
    "added": "added",
    "removed": "removed",
    "status": "status",
    "breaker_open": "breaker open",
    "breaker_closed": "breaker closed",
    "operation_started": "op started",
    "operation_succeeded": "op succeeded",
    "operation_failed": "op failed",
    "operation_cancelled": "op cancelled",
    "note": "note",
}
"""How the timeline names each journal event (12 characters at most)."""

# event → (level, palette style); `status` and `added` take the colour of the status the node turned to.
_LOOKS: dict[str, tuple[str, str]] = {
    "removed": ("info", "status-unknown"),
    "breaker_open": ("warning", "status-unhealthy"),
    "breaker_closed": ("info", "status-healthy"),
    "operation_started": ("info", "status-relaunching"),
    "operation_succeeded": ("info", "status-healthy"),
    "operation_failed": ("error", "log-error"),
    "operation_cancelled": ("warning", "log-warning"),
}
_WORSE = {"unhealthy": "warning", "relaunch_failed": "error", "failed": "error"}


def journal_record(entry: Mapping[str, Any]) -> LogRecord:
    """A journal entry as a timeline row: its time, node, event (coloured), and `summary — reason`."""
    event = str(entry.get("event", "note"))
    at: datetime | None
    try:
        at = datetime.fromisoformat(str(entry["at"])) if entry.get("at") else None
    except ValueError:
        at = None
    if event in ("status", "added"):
        to = str(entry.get("to") or "unknown")
        level, style = _WORSE.get(to, "info"), "status-" + to.replace("_", "-")
    else:
        level, style = _LOOKS.get(event, ("info", "log-info"))
    summary = str(entry.get("summary") or event)
    reason = entry.get("reason")
    return LogRecord(
        level=level,
        message=f"{summary} — {reason}" if reason else summary,
        at=at,
        source=str(entry.get("node", "")),
        tag=EVENT_LABELS.get(event, event[:12]),
        tag_style=style,
    )


async def journal_records(entries: AsyncIterator[Mapping[str, Any]]) -> AsyncIterator[LogRecord]:
    """The timeline rows of a journal stream (`QiipClient.journal`), as they come."""
    async for entry in entries:
        yield journal_record(entry)


def engine_record(item: Mapping[str, Any]) -> LogRecord:
    """An engine-log event as a log line: a `line` as it is, a `reset` (a relaunch) as a warning."""
    if item.get("event") == "reset":
        return LogRecord(level="warning", message=str(item.get("reason", "the log started again")), tag="relaunch")
    return LogRecord(level="info", message=str(item.get("line", "")), tag="")


async def engine_records(items: AsyncIterator[Mapping[str, Any]]) -> AsyncIterator[LogRecord]:
    """The lines of an engine-log stream (`QiipClient.engine_log`), as they come."""
    async for item in items:
        yield engine_record(item)
