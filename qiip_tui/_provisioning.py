"""What the provisioning screen shows of the daemon's task records and host logs, without a terminal.

The daemon's task record (`GET /admin/provisioning/tasks`) and log entry (`{ts, level, msg, stream, step}`) are
plain JSON here; these functions turn them into table cells and `LogRecord`s, and name the engines and power
actions the console offers, so the screen and the dialogs share one spelling.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from datetime import datetime
from typing import Any

from qiip_core.nodes import PROVISIONED_ENGINES, Engine
from qiip_tui._types import LogRecord

__all__ = [
    "ENGINES",
    "POWER_ACTIONS",
    "TASK_COLUMNS",
    "format_elapsed",
    "log_record",
    "log_records",
    "setup_sizing",
    "task_cells",
]

ENGINES: dict[str, Engine] = {engine.label: engine for engine in PROVISIONED_ENGINES}
"""The engines a setup offers: the name the operator reads (`Engine.label`) → the engine."""

POWER_ACTIONS: dict[str, tuple[str, str]] = {
    "on": ("On", "Power on"),
    "off": ("ForceOff", "Power off"),
    "restart": ("GracefulRestart", "Restart"),
}
"""The power actions: console name → (the BMC's reset type, the label)."""

TASK_COLUMNS = ("Host", "Kind", "Engine", "Step", "Elapsed", "State")
"""The task table's columns."""

_ENGINE_LABELS = {engine.value: engine.label for engine in Engine}


_SLOTS_BY_CONTEXT = re.compile(r"^\s*(\d{1,4})\s*[x×*]\s*([\d_,]{1,12})\s*$")


def setup_sizing(text: str) -> dict[str, Any] | None:
    """The sizing policy a setup form's field names: empty or `auto` → None (the daemon's automatic sizing, bounded
    on CPU hosts); `SLOTSxCONTEXT` (`2x4096`) → a custom policy of that many slots of that many tokens each (F16
    K/V, 512 MiB left free). The values' rules (slots 1-256, a context a multiple of 256 within the model's) are the
    daemon's, which answers the setup with the field at fault.

    Raises:
        ValueError: the text is neither (the message says what is expected).
    """
    word = text.strip().lower()
    if word in ("", "auto"):
        return None
    match = _SLOTS_BY_CONTEXT.match(word)
    if match is None:
        raise ValueError(f"The sizing {text.strip()!r} is neither auto nor SLOTSxCONTEXT, such as 2x4096.")
    slots, context = int(match.group(1)), int(match.group(2).replace("_", "").replace(",", ""))
    return {"sizing": "custom", "slots": slots, "context_per_slot": context, "cache_type": "f16", "fit_target_mib": 512}


def format_elapsed(seconds: float) -> str:
    """`42s`, `3m05s`, `2h01m`: a task's elapsed time in seconds, short."""
    whole = max(0, int(seconds))
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def task_cells(task: Mapping[str, Any]) -> tuple[str, ...]:
    """A task record's cells, in `TASK_COLUMNS` order; a failed task's step is the one that failed."""
    state = str(task.get("state", "unknown"))
    step = task.get("failed_step") if state == "failed" and task.get("failed_step") else task.get("current_step")
    engine = task.get("engine") or ""
    return (
        str(task.get("hostname", "")),
        str(task.get("kind", "setup")),
        _ENGINE_LABELS.get(engine, engine),
        str(step or ""),
        format_elapsed(float(task.get("elapsed_s") or 0.0)),
        state,
    )


def log_record(entry: Mapping[str, Any]) -> LogRecord:
    """A host log entry as the log view's record: its level, message, time, and step as the source."""
    at: datetime | None
    try:
        at = datetime.fromisoformat(str(entry["ts"])) if entry.get("ts") else None
    except ValueError:
        at = None
    return LogRecord(
        level=str(entry.get("level", "info")),
        message=str(entry.get("msg", "")),
        at=at,
        source=str(entry.get("step") or ""),
    )


async def log_records(entries: AsyncIterator[Mapping[str, Any]]) -> AsyncIterator[LogRecord]:
    """The records of a host log stream (`QiipClient.host_log`), as they come."""
    async for entry in entries:
        yield log_record(entry)
