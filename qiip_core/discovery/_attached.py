"""Attached endpoints: existing OpenAI-compatible servers an administrator approved in `[[attached]]`.

An attached server is not QIIP's: it is reached over HTTPS with normal certificate checks (plain HTTP only
to a numeric loopback address, which the profile's validation enforces), redirects are never followed,
proxy environment variables never apply, and its bearer token comes from a file that must be a private
regular file. The token is sent to that server only and is never shown anywhere.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from qiip_core._errors import ConfigError
from qiip_core.config import AttachedProfile
from qiip_core.nodes import Engine, Node, NodeStatus

__all__ = ["MAX_TOKEN_FILE_BYTES", "attached_node", "read_token_file"]

MAX_TOKEN_FILE_BYTES = 16 * 1024
"""A token file larger than this is refused."""


def read_token_file(path: Path, *, profile: str = "", setting: str | None = None, what: str = "token file") -> str:
    """Read an attached server's bearer token (or another secret, such as a BMC password) from a private regular
    file.

    Args:
        path: the file.
        profile: the attached profile's name, for messages.
        setting: the setting naming the file, for messages (default: `attached.<profile>.token_file`).
        what: what the file is, for messages.

    Returns:
        The token, stripped of surrounding whitespace.

    Raises:
        ConfigError: the file is missing, a symlink or not a regular file, readable or writable by group or
            others, owned by another user, too large, or empty. The message never contains its content.
    """
    where = f"{setting or f'attached.{profile}.token_file'} ({path})"
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"The {what} {where} cannot be read: {exc.strerror}.") from exc
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"The {what} {where} must be a regular file, not a link or a device.")
    if info.st_mode & 0o077:
        raise ConfigError(
            f"The {what} {where} is readable or writable by others (mode {stat.S_IMODE(info.st_mode):03o}); "
            "make it private: chmod 600."
        )
    if info.st_uid != os.geteuid():
        raise ConfigError(f"The {what} {where} belongs to another user; it must be the daemon's own.")
    if info.st_size > MAX_TOKEN_FILE_BYTES:
        raise ConfigError(f"The {what} {where} is larger than {MAX_TOKEN_FILE_BYTES} bytes.")
    token = path.read_text(encoding="utf-8", errors="strict").strip()
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError(f"The {what} {where} must hold one line without spaces (one token or password).")
    return token


def attached_node(profile: AttachedProfile) -> Node:
    """The node an attached profile becomes: engine `attached`, capped at the profile's concurrency and
    deadline."""
    capabilities = profile.capabilities.model_copy(
        update={"concurrency": profile.concurrency, "deadline_s": profile.deadline_s}
    )
    return Node(
        id=profile.name,
        endpoint=profile.url,
        model=profile.model,
        engine=Engine.ATTACHED,
        capabilities=capabilities,
        status=NodeStatus.UNKNOWN,
        managed=False,
    )
