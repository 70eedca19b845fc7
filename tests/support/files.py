"""A directory served over HTTP on loopback, as a site mirror serves release archives and installers to hosts."""

from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path

__all__ = ["LoopbackFileServer"]


class LoopbackFileServer:
    """The files under `directory` served on 127.0.0.1 and a free port by a thread, from `with` to its end.

    Attributes:
        url: the base URL, `http://127.0.0.1:<port>` (no trailing slash).
    """

    def __init__(self, directory: Path) -> None:
        handler = functools.partial(_QuietHandler, directory=str(directory))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> LoopbackFileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        return None
