"""The QIIP daemon: the OpenAI-compatible client API, the admin API and Prometheus metrics."""

from __future__ import annotations

import sys

__all__ = ["main"]


def _headless() -> None:
    # The daemon never draws. structlog imports Rich when it can find it (for tracebacks and colours the daemon does
    # not use: its renderers are JSON and plain text), about a tenth of a second of every start of the daemon and of
    # each worker process. An entry of None makes `import rich` fail there; a process that imported it already keeps
    # it.
    sys.modules.setdefault("rich", None)  # type: ignore[arg-type]


def main() -> None:
    """Entry point of `qiip-proxy`."""
    _headless()
    from qiip_proxy._cli import main as _main

    _main()
