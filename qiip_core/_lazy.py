"""Lazy re-exports for a package's `__init__` (PEP 562): a public name's module is imported on first use.

A package whose modules pull in heavy dependencies (NVML, etcd, the GGUF reader) keeps `import qiip_core.x` cheap
by naming, per public name, the private module that defines it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, modules: Mapping[str, str], exported: Collection[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package`.

    Args:
        package: the package's `__name__`.
        modules: public name → the private module (relative to `package`) that defines it.
        exported: the package's `__all__`.

    Returns:
        `(__getattr__, __dir__)`: the first imports a name's module on first use and keeps the value in the
        package's namespace, so later lookups never reach it.
    """

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exported))

    return __getattr__, __dir__
