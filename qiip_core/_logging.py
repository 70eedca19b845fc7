"""One logging configuration for the daemon and the CLI.

Modules log through the standard library (`logging.getLogger("qiip.<area>")`, lazy `%s` arguments);
structlog's `ProcessorFormatter` renders every record, ours and the libraries', as JSON lines for log
collectors or as aligned console lines for people.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

__all__ = ["configure_logging"]


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
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
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
