"""`qiip`, the operator's command line: start the gateway, manage nodes, engines and test models."""

from __future__ import annotations

__all__ = ["main"]


def main() -> None:
    """Entry point of `qiip`."""
    from qiip_cli._main import cli

    cli()
