"""`AbsolutePath`: a path one process hands another (`qiip up` to the daemon), checked where it is read.

A path read from a record (`QIIP_LOCAL_NODE_PLAN`) is used as a program or model to open in another process and
another directory, so it must be whole: pydantic would turn "" into "." and pass a NUL byte or a newline through
to `open()` and to llama-server's argv. This refuses those when the record is read, naming the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator

__all__ = ["AbsolutePath", "check_absolute_path"]


def check_absolute_path(value: object) -> object:
    """Check that `value`, a path as text (or a `Path`), is absolute and printable; other types are left to
    pydantic's type check.

    Returns:
        `value` unchanged.

    Raises:
        ValueError: it is empty, holds a NUL byte or another control character, or is relative.
    """
    if not isinstance(value, str | Path):
        return value
    text = str(value)
    if not text:
        raise ValueError("is empty; it must be the absolute path of a file")
    if not text.isprintable():
        raise ValueError(f"holds a NUL byte or control character ({text!r}); it must be a printable absolute path")
    if not os.path.isabs(text):
        raise ValueError(f"is relative ({text!r}); it must be an absolute path")
    return value


AbsolutePath = Annotated[Path, BeforeValidator(check_absolute_path)]
"""A path that is absolute and printable (`check_absolute_path`), as records handed between processes carry it."""
