"""One logging configuration for the daemon and the CLI.

Modules log through the standard library (`logging.getLogger("qiip.<area>")`, lazy `%s` arguments);
structlog's `ProcessorFormatter` renders every record, ours and the libraries', as JSON lines for log
collectors or as aligned console lines for people. Either way a record is one line: the JSON renderer escapes
control characters, and the console renderer gets the message with them escaped (`escape_controls`), so no value
a client chose (a path, a header, a model name) can start a forged line or drive the reader's terminal.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

from qiip_core._errors import escape_controls

__all__ = ["configure_logging"]


def _one_line(logger: object, method: str, event: structlog.types.EventDict) -> structlog.types.EventDict:
    """A structlog processor: the record's message and string fields with control characters escaped."""
    for key, value in event.items():
        if isinstance(value, str) and key != "exception":
            event[key] = escape_controls(value)
    return event


def configure_logging(*, level: str = "INFO", format: Literal["console", "json"] = "console") -> None:
    """Route all logging to stderr through structlog's formatter.

    Args:
        level: the lowest level written (`DEBUG` … `CRITICAL`).
        format: `json` (one object per line) or `console`.
    """
    shared: list[structlog.types.Processor] = [
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor
    if format == "json":
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
        escape: list[structlog.types.Processor] = []
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
        escape = [_one_line]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *escape, renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Access logs per request would dominate; the daemon keeps its own request metrics.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    # asyncssh logs every remote command line at INFO, environment values included (a package index URL may hold
    # credentials); QIIP logs them itself at DEBUG with the values redacted.
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
