"""Inference engines QIIP installs, launches and verifies on its own hosts.

One subpackage per engine: `llamacpp` builds llama.cpp's `llama-server` from a pinned, verified source,
writes small test models, and runs `llama-server` as a supervised child process. Import from the
subpackage (`from qiip_core.engines.llamacpp import LlamaServerProcess`); this package itself exports
nothing, so importing it costs nothing.
"""

from __future__ import annotations

__all__: list[str] = []
