"""Ask a host what it can run well: llmfit installed over SSH, run there, and its answer normalised.

```
Recommender(settings, check_host=…, known_hosts=…)
  .recommend(host, profile=…, limit=…, catalog_repos=…)
      check_host(host)                         400 outside the node allowlist, before any SSH work
      open_ssh(SshTarget.for_host(host, …))    the provisioning SSH layer: strict host keys, deadlines
      install_llmfit(ssh, binary)              reuse, or upload + sha256sum + rename
      llmfit [--profile P] recommend --json --no-dashboard -n N     exit status 0, stdout parsed
      parse_recommendations(stdout, …)         → HostRecommendations
```

The whole request runs under `provisioning.llmfit_timeout_s`, and llmfit's stdout is read up to
`MAX_OUTPUT_BYTES` (more stops it: a host flooding the gateway costs it a bounded amount). llmfit prints warnings
on stderr on some hosts (a `GLIBC_2.39` weak-version note on older C libraries): stderr is never a failure, only the
exit status is, and only its last lines are kept.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import shlex
import socket
from collections.abc import Callable, Collection
from pathlib import Path

from qiip_core._errors import HostNotFound, LlmfitError, RemoteTimeout, SshError
from qiip_core.catalog import Catalog
from qiip_core.config import Settings
from qiip_core.provisioning import SshConnection, SshTarget, open_ssh
from qiip_core.recommendations._install import LlmfitBinary, install_llmfit
from qiip_core.recommendations._types import HostRecommendations, parse_recommendations

__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "MAX_OUTPUT_BYTES", "PROFILE_PATTERN", "Recommender", "catalog_repos"]

logger = logging.getLogger("qiip.recommendations")

PROFILE_PATTERN = r"^[A-Za-z0-9_./][A-Za-z0-9_./+-]{0,254}$"
"""An llmfit hardware profile: a name (`llmfit hardware list`, such as `nvidia-rtx-4090`) or a profile JSON's path
on the host."""

DEFAULT_LIMIT = 10
"""Recommendations asked of llmfit when the caller names no number (its `-n`)."""
MAX_LIMIT = 100

MAX_OUTPUT_BYTES = 16 * 1024 * 1024
"""The most of llmfit's stdout read, in bytes (the cap QUADS' answers have); `-n 100` prints well under 1 MiB."""


def catalog_repos(catalog: Catalog) -> frozenset[str]:
    """The repository ids QIIP's catalog offers: its GGUF generations' and its full (safetensors) models'."""
    return frozenset(g.repo_id for g in catalog.gguf) | frozenset(m.repo_id for m in catalog.full)


class Recommender:
    """Runs llmfit on hosts for the admin API.

    Args:
        settings: the daemon's settings (`provisioning.ssh_*`, `host_key_policy`, `connect_timeout_s`,
            `llmfit_timeout_s`).
        check_host: normalises a host name and refuses one outside the node allowlist (`Provisioner.check_host`).
        known_hosts: the known-hosts file host keys are checked against.
        binary: the llmfit to install; None finds the environment's on first use (`LlmfitBinary.from_environment`).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        check_host: Callable[[str], str],
        known_hosts: Path,
        binary: LlmfitBinary | None = None,
    ) -> None:
        self.settings = settings
        self.check_host = check_host
        self.known_hosts = known_hosts
        self._binary = binary
        self._finding = asyncio.Lock()

    async def binary(self) -> LlmfitBinary:
        """The gateway's llmfit, found (and its digest checked) once.

        Raises:
            LlmfitNotInstalled: the environment lacks it (see `LlmfitBinary.from_environment`).
        """
        async with self._finding:
            if self._binary is None:
                self._binary = await asyncio.to_thread(LlmfitBinary.from_environment)
            return self._binary

    async def recommend(
        self,
        host: str,
        *,
        profile: str | None = None,
        limit: int = DEFAULT_LIMIT,
        catalog_repos: Collection[str] = (),
    ) -> HostRecommendations:
        """Install llmfit on `host` if needed, run `llmfit recommend --json` there and normalise its answer.

        Args:
            host: the host's name or address, inside the node allowlist.
            profile: an llmfit hardware profile (`--profile`) to score against instead of the host's hardware.
            limit: how many recommendations, 1–`MAX_LIMIT` (llmfit's `-n`).
            catalog_repos: QIIP's catalog repository ids (`catalog_repos(scan_catalog(…))`), for `in_catalog`.

        Returns:
            The host's recommendations, best first.

        Raises:
            ValueError: `profile` or `limit` is out of bounds (`PROFILE_PATTERN`, 1–`MAX_LIMIT`).
            HostNotAllowed: the host is malformed or outside the allowlist (400; nothing was contacted).
            HostNotFound: the host name does not resolve (404).
            LlmfitNotInstalled: the gateway's environment lacks llmfit (503).
            SshError, HostKeyMismatch: SSH failed (502).
            LlmfitError: llmfit could not be placed on the host, exited non-zero, or printed something else (502).
            RemoteTimeout: the whole request took longer than `provisioning.llmfit_timeout_s` (504).
        """
        if profile is not None and not re.match(PROFILE_PATTERN, profile):
            raise ValueError(f"{profile!r} is not an llmfit hardware profile name or path")
        if not 1 <= limit <= MAX_LIMIT:
            raise ValueError(f"limit must be 1-{MAX_LIMIT}, not {limit}")
        host = self.check_host(host)
        binary = await self.binary()
        timeout_s = self.settings.provisioning.llmfit_timeout_s
        target = SshTarget.for_host(host, self.settings.provisioning, known_hosts=self.known_hosts)
        try:
            async with asyncio.timeout(timeout_s):
                async with open_ssh(target) as ssh:
                    path = await install_llmfit(ssh, binary)
                    stdout = await _run(ssh, path, profile=profile, limit=limit, timeout_s=timeout_s)
        except SshError as exc:
            if isinstance(exc.__cause__, socket.gaierror):
                raise HostNotFound(
                    f"{host} does not resolve to an address ({exc.__cause__.strerror}); check the name.", host=host
                ) from exc
            raise
        except TimeoutError:
            raise RemoteTimeout(
                f"llmfit on {host} did not answer within {timeout_s:g} s (provisioning.llmfit_timeout_s); it was "
                "stopped.",
                host=host,
            ) from None
        return parse_recommendations(stdout, host=host, profile=profile, catalog_repos=catalog_repos)


_GLIBC_NOTE = re.compile(r"version [`']GLIBC_[\d.]+' not found|\bGLIBC_[\d.]+\b.*\bweak\b", re.IGNORECASE)
"""The C library's version note llmfit's binary triggers on older systems (harmless, not its reason to fail)."""


async def _run(ssh: SshConnection, path: str, *, profile: str | None, limit: int, timeout_s: float) -> str:
    """llmfit's stdout; a non-zero exit is an `LlmfitError` with its last lines of stderr."""
    args = [path]
    if profile is not None:
        args += ["--profile", profile]  # a global flag: it goes before the subcommand
    args += ["recommend", "--json", "--no-dashboard", "-n", str(limit)]
    stdout: list[str] = []
    stderr: collections.deque[str] = collections.deque(maxlen=20)
    size = [0]

    def keep(line: str, stream: str) -> None:
        if stream != "stdout":
            stderr.append(line)
            return
        size[0] += len(line.encode()) + 1
        if size[0] > MAX_OUTPUT_BYTES:
            raise LlmfitError(
                f"llmfit on {ssh.target.host} printed more than {MAX_OUTPUT_BYTES:,} bytes; it was stopped.",
                host=ssh.target.host,
            )
        stdout.append(line)

    result = await ssh.run(
        shlex.join(args), on_line=keep, total_timeout_s=timeout_s, idle_timeout_s=timeout_s, what="llmfit"
    )
    if result.exit_status != 0:
        # The C library's weak-version note (`… version `GLIBC_2.39' not found (required by …)`, which llmfit prints
        # on every run on an older system) says nothing about why it failed: its own message follows it.
        said = [line for line in stderr if line.strip() and not _GLIBC_NOTE.search(line)]
        reason = " | ".join(said[-3:]) or "no message"
        raise LlmfitError(
            f"llmfit on {ssh.target.host} exited with {result.exit_status}: {reason}", host=ssh.target.host
        )
    return "\n".join(stdout)
