"""The QIIP operator console (Textual). It talks to a running daemon through `qiip_core.client`, never to nodes.

`QiipConsole` is the app; `qiip console` runs it. Its themes are data files (`load_theme_file`), and what it
needs from a daemon is `ConsoleClient`.
"""

from __future__ import annotations

from qiip_tui._app import QiipConsole
from qiip_tui._themes import ThemeFile, ThemeFileError, load_theme_file, load_themes
from qiip_tui._types import ConsoleClient, JournalSource, LogRecord, ProvisioningSource

__all__ = [
    "ConsoleClient",
    "JournalSource",
    "LogRecord",
    "ProvisioningSource",
    "QiipConsole",
    "ThemeFile",
    "ThemeFileError",
    "load_theme_file",
    "load_themes",
]
