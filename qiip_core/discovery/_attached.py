"""Attached endpoints: existing OpenAI-compatible servers an administrator approved in `[[attached]]`.

An attached server is not QIIP's: it is reached over HTTPS with normal certificate checks (plain HTTP only
to a numeric loopback address, which the profile's validation enforces), redirects are never followed,
proxy environment variables never apply, and its bearer token comes from a file that must be a private
regular file in a directory no one else writes. The token is sent to that server only and is never shown anywhere.
"""

from __future__ import annotations

import errno
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

    The file is opened once, without following a link (`O_NOFOLLOW`), relative to its directory opened first, and
    what is checked is what was opened (`fstat` of both): a swap of the path between a check and the read cannot
    substitute another file, and a directory others may write in (where anyone could swap it) is refused.

    Args:
        path: the file.
        profile: the attached profile's name, for messages.
        setting: the setting naming the file, for messages (default: `attached.<profile>.token_file`).
        what: what the file is, for messages.

    Returns:
        The token, stripped of surrounding whitespace.

    Raises:
        ConfigError: the file is missing, a symlink or not a regular file, readable or writable by group or
            others, owned by another user, too large, or empty; or its directory is writable by group or others,
            or owned by another user than the daemon's or root. The message never contains its content.
    """
    where = f"{setting or f'attached.{profile}.token_file'} ({path})"
    path = Path(os.path.abspath(path))
    try:
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"The {what} {where} cannot be read: {exc.strerror}.") from exc
    try:
        folder = os.fstat(directory)
        if folder.st_mode & 0o022:
            raise ConfigError(
                f"The {what} {where} is in a directory others may write in (mode {stat.S_IMODE(folder.st_mode):03o}), "
                "where it could be replaced; move it to a directory only its owner writes (chmod go-w)."
            )
        if folder.st_uid not in (os.geteuid(), 0):
            raise ConfigError(
                f"The {what} {where} is in a directory of another user; it must be the daemon's or root's."
            )
        try:
            fd = os.open(
                path.name,
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                dir_fd=directory,
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ConfigError(f"The {what} {where} must be a regular file, not a link or a device.") from exc
            raise ConfigError(f"The {what} {where} cannot be read: {exc.strerror}.") from exc
    finally:
        os.close(directory)
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"The {what} {where} must be a regular file, not a link or a device.")
        if info.st_mode & 0o077:
            raise ConfigError(
                f"The {what} {where} is readable or writable by others (mode {stat.S_IMODE(info.st_mode):03o}); "
                "make it private: chmod 600."
            )
        if info.st_uid != os.geteuid():
            raise ConfigError(f"The {what} {where} belongs to another user; it must be the daemon's own.")
        data = file.read(MAX_TOKEN_FILE_BYTES + 1)
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise ConfigError(f"The {what} {where} is larger than {MAX_TOKEN_FILE_BYTES} bytes.")
    try:
        token = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        token = ""
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
