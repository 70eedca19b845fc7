"""The QIIP daemon: the OpenAI-compatible client API, the admin API and Prometheus metrics."""

from __future__ import annotations

__all__ = ["main"]


def main() -> None:
    """Entry point of `qiip-proxy`."""
    from qiip_proxy._cli import main as _main

    _main()
