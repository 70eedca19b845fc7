"""The QIIP operator console (Textual). It talks to a running daemon, never to nodes directly."""

from __future__ import annotations

__all__ = ["QiipConsole"]

from qiip_tui._app import QiipConsole
