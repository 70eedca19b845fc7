"""llmfit on a host: the binary the gateway holds, copied over SFTP and checked by its SHA-256 there.

The gateway's environment installs llmfit from its published wheel (`llmfit==1.1.17` in pyproject.toml; uv.lock
pins the wheel's sha256, and `uv sync` puts the binary in `.venv/bin/llmfit`). `LlmfitBinary.from_environment()`
finds that binary through the wheel's installed metadata and checks it against the wheel's `RECORD` digest, so the
digest sent to hosts is the locked wheel's.

On a host, `install_llmfit` keeps it at `<install root>$HOME/.cache/qiip/llmfit/<version>/llmfit` (the install root
is empty on a real host): a binary already there whose SHA-256 matches is reused; otherwise the binary is uploaded
into a fresh temporary directory beside it, checked with `sha256sum` on the host, and renamed into place, so a
reader never sees a partial file and a failed upload leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.metadata
import logging
import re
import secrets
import shlex
from dataclasses import dataclass
from pathlib import Path

from qiip_core._errors import LlmfitError, LlmfitNotInstalled
from qiip_core.provisioning import SshConnection
from qiip_core.recommendations._types import LLMFIT_VERSION

__all__ = ["LlmfitBinary", "install_llmfit", "remote_llmfit_dir"]

logger = logging.getLogger("qiip.recommendations")

_CHECK_TIMEOUT_S = 120.0
_DIR_COMMAND = 'root="${QIIPNODE_ROOT:-}"; root="${root%/}"; printf "%s\\n" "$root$HOME/.cache/qiip/llmfit/"'
"""Prints llmfit's directory on the host, without the version; `QIIPNODE_ROOT` is the install root, as in
provisioning's preflight (empty on a real host)."""


@dataclass(frozen=True, slots=True)
class LlmfitBinary:
    """The llmfit binary of the gateway's environment.

    Attributes:
        path: the executable (`.venv/bin/llmfit`).
        version: its release (`1.1.17`).
        sha256: its SHA-256, lower-case hex, equal to its wheel's `RECORD` entry.
    """

    path: Path
    version: str
    sha256: str

    @classmethod
    def from_environment(cls, *, distribution: str = "llmfit", version: str = LLMFIT_VERSION) -> LlmfitBinary:
        """Find the binary the `llmfit` wheel installed in this Python environment and check its digest.

        Blocking (it reads 37 MB): call it in a thread from async code.

        Args:
            distribution: the installed distribution's name.
            version: the release it must be.

        Raises:
            LlmfitNotInstalled: the distribution is missing, of another version, without its binary, or the binary's
                SHA-256 differs from the wheel's `RECORD`.
        """
        fix = "run `uv sync` in the gateway's project (pyproject.toml pins llmfit==" + version + ")"
        try:
            dist = importlib.metadata.distribution(distribution)
        except importlib.metadata.PackageNotFoundError:
            raise LlmfitNotInstalled(
                f"The gateway's Python environment has no {distribution} package, whose binary hosts run; {fix}."
            ) from None
        if dist.version != version:
            raise LlmfitNotInstalled(
                f"The gateway's Python environment has {distribution} {dist.version}, not {version}; {fix}."
            )
        entry = next(
            (f for f in dist.files or () if f.parts[-2:] == ("bin", "llmfit") and f.hash is not None),
            None,
        )
        path = Path(str(entry.locate())).resolve() if entry is not None else None
        if entry is None or entry.hash is None or path is None or not path.is_file():
            raise LlmfitNotInstalled(
                f"The {distribution} {version} package of the gateway's environment lacks its llmfit binary; {fix}."
            )
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        recorded = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4)).hex()
        if entry.hash.mode != "sha256" or digest.hexdigest() != recorded:
            raise LlmfitNotInstalled(
                f"The llmfit binary {path} is not the one its wheel installed (SHA-256 {digest.hexdigest()}, the "
                f"wheel's RECORD says {recorded}); {fix}."
            )
        return cls(path=path, version=version, sha256=recorded)


async def remote_llmfit_dir(ssh: SshConnection, version: str) -> str:
    """Where llmfit `version` lives on the host: `<install root>$HOME/.cache/qiip/llmfit/<version>`.

    Raises:
        ValueError: `version` is not a release number.
        LlmfitError: the host gave no absolute home directory.
        SshError: the command failed; RemoteTimeout: it did not answer in time.
    """
    if not re.match(r"^[0-9][0-9A-Za-z.+-]{0,63}$", version):
        raise ValueError(f"{version!r} is not a version")
    out = await ssh.output(_DIR_COMMAND, timeout_s=_CHECK_TIMEOUT_S, what="finding llmfit's directory")
    directory = (out.strip().splitlines()[-1] + version) if out.strip() else ""
    if not directory.startswith("/"):
        raise LlmfitError(
            f"{ssh.target.host} gave no absolute home directory for llmfit ({out!r}).", host=ssh.target.host
        )
    return directory


async def _remote_sha256(ssh: SshConnection, path: str) -> str | None:
    out = await ssh.output(
        f"if [ -f {shlex.quote(path)} ]; then sha256sum {shlex.quote(path)}; fi",
        timeout_s=_CHECK_TIMEOUT_S,
        what="checking llmfit's SHA-256",
    )
    return out.split()[0] if out.split() else None


async def install_llmfit(ssh: SshConnection, binary: LlmfitBinary) -> str:
    """Make `binary` present on the host, unchanged, and return its path there.

    A binary already at the path whose SHA-256 matches is reused; any other (missing, corrupted, another build) is
    replaced: uploaded into a temporary directory next to it, checked, then renamed over it.

    Args:
        ssh: a connection to the host.
        binary: the gateway's llmfit.

    Returns:
        The absolute path of llmfit on the host.

    Raises:
        LlmfitError: the uploaded copy's SHA-256 is not `binary.sha256` (the copy was removed).
        SshError: SFTP or a command failed; RemoteTimeout: a command did not answer in time.
    """
    host = ssh.target.host
    directory = await remote_llmfit_dir(ssh, binary.version)
    target = f"{directory}/llmfit"
    if await _remote_sha256(ssh, target) == binary.sha256:
        logger.debug("llmfit %s is already on %s at %s", binary.version, host, target)
        return target
    staging = f"{directory}/.upload-{secrets.token_hex(8)}"
    try:
        await ssh.upload([binary.path], staging)
        uploaded = f"{staging}/{binary.path.name}"
        actual = await _remote_sha256(ssh, uploaded)
        if actual != binary.sha256:
            raise LlmfitError(
                f"The llmfit copied to {host} has SHA-256 {actual}, not {binary.sha256}; it was removed.", host=host
            )
        await ssh.output(
            f"chmod 0755 {shlex.quote(uploaded)} && mv -f {shlex.quote(uploaded)} {shlex.quote(target)}",
            timeout_s=_CHECK_TIMEOUT_S,
            what="placing llmfit",
        )
        logger.info("installed llmfit %s on %s at %s", binary.version, host, target)
        return target
    finally:
        await asyncio.shield(_remove(ssh, staging))


async def _remove(ssh: SshConnection, staging: str) -> None:
    try:
        await ssh.output(f"rm -rf {shlex.quote(staging)}", timeout_s=_CHECK_TIMEOUT_S, what="removing an upload")
    except Exception as exc:  # the upload's own error (or success) matters more than its leftovers
        logger.warning("could not remove %s on %s: %s", staging, ssh.target.host, exc)
