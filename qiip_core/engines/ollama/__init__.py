"""Ollama: the daemon QIIP runs on a host for it, and how a verified GGUF becomes its model.

```
serve_environment(bind=…, port=…, root=…, slots=…, context_per_slot=…)   `ollama serve`'s environment: QIIP's
                                                                       port and store, no cloud, no registry
install_environment(version=…, sha256=…, url_template=…)  the bundle's `ollama_install` step: a pinned release,
                                            or the installed binary of that version
check_ollama_name(name)                     a model name by Ollama's own rules, or ValueError naming the part
install_model(endpoint, name=…, gguf=…, sha256=…, session=…)            the GGUF pushed as a blob by its digest,
                                            the model created from it, loaded and checked (`/api/ps`, `/api/show`)
```

An Ollama server QIIP did not start is a node like any other (`Engine.OLLAMA`): its health and loaded models are
read by `qiip_core.health` from the shapes in `qiip_core.nodes`.

Names load on first use (PEP 562): checking a name does not import the HTTP client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qiip_core._lazy import lazy_exports

if TYPE_CHECKING:
    from qiip_core.engines.ollama._push import InstalledModel, OllamaInstallFailed, install_model
    from qiip_core.engines.ollama._serve import (
        OLLAMA_STORE,
        check_ollama_name,
        install_environment,
        serve_environment,
    )

__all__ = [
    "OLLAMA_STORE",
    "InstalledModel",
    "OllamaInstallFailed",
    "check_ollama_name",
    "install_environment",
    "install_model",
    "serve_environment",
]

_MODULES = {
    "OLLAMA_STORE": "_serve",
    "InstalledModel": "_push",
    "OllamaInstallFailed": "_push",
    "check_ollama_name": "_serve",
    "install_environment": "_serve",
    "install_model": "_push",
    "serve_environment": "_serve",
}

__getattr__, __dir__ = lazy_exports(__name__, _MODULES, __all__)
