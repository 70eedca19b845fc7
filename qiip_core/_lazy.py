"""Imports on first use: lazy re-exports for a package's `__init__` (PEP 562), and a dependency module imported
when a function first reaches for it (`LazyModule`).

A package whose modules pull in heavy dependencies (NVML, etcd, the GGUF reader) keeps `import qiip_core.x` cheap
by naming, per public name, the private module that defines it; a module whose dependency only some commands use
(asyncssh, about a second of start-up on a busy machine) names it through a `LazyModule`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ["LazyModule", "lazy_exports"]


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


class LazyModule:
    """A module imported on its first attribute lookup (`asyncssh.connect` runs `import asyncssh` the first time).

    Declare it beside a `TYPE_CHECKING` import of the real module, so the type checker sees the module itself:

        if TYPE_CHECKING:
            import asyncssh
        else:
            asyncssh = LazyModule("asyncssh")

    Every lookup goes through `importlib.import_module` (a `sys.modules` hit after the first, under the import
    lock, so first uses from two threads are safe); `except asyncssh.Error` imports the module when an exception
    reaches that clause.
    """

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"
