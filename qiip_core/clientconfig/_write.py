"""Write a rendered client config to disk: atomically, private to its owner, never over a file unless asked.

The front ends never write into an agent's own config location (`~/.pi/agent/models.json`, …): that file may hold
the user's other providers. The CLI writes where it is told; the console writes under
`$XDG_CONFIG_HOME/qiip/client-configs/<client>/<model>/`, QIIP's own directory, and says where.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from qiip_core.clientconfig._types import ClientConfig, ClientKind
from qiip_core.storage import atomic_write

__all__ = ["generated_config_path", "write_client_config"]


def generated_config_path(client: ClientKind, model: str, file_name: str, env: Mapping[str, str] | None = None) -> Path:
    """Where the console keeps a generated config: `$XDG_CONFIG_HOME/qiip/client-configs/<client>/<model>/<file>`
    (`~/.config` when the variable is unset), the model id made a safe directory name (`org/name` → `org_name`).
    """
    env = os.environ if env is None else env
    config_home = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    folder = re.sub(r"[^A-Za-z0-9._-]", "_", model).lstrip(".") or "model"
    return config_home / "qiip" / "client-configs" / client.value / folder / file_name


def write_client_config(config: ClientConfig, path: Path, *, force: bool = False, parents: bool = False) -> Path:
    """Write `config` to `path` (to `path / config.file_name` when `path` is a directory): a temporary file in
    the same directory, fsynced, then renamed over, with mode 0600 since it may hold a key.

    Args:
        config: the rendered config.
        path: the file, or a directory to put it in.
        force: replace an existing file.
        parents: create missing parent directories (the console's own folder); without it a missing directory
            is refused, so a mistyped path never leaves new directories behind.

    Returns:
        The file written.

    Raises:
        FileExistsError: the file exists and `force` is false (nothing is written).
        FileNotFoundError: the directory does not exist and `parents` is false (nothing is written).
        OSError: the directory cannot be created or written.
    """
    target = path / config.file_name if path.is_dir() else path
    if not parents and not target.parent.is_dir():
        raise FileNotFoundError(f"{target.parent} is not a directory; create it first (nothing was written).")
    if target.exists() and not force:
        raise FileExistsError(f"{target} exists; pass --force to replace it.")
    atomic_write(target, config.text.encode())
    return target
