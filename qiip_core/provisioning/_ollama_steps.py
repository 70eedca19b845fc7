"""The steps of a setup that are Ollama's own: that the daemon answering is the one QIIP started, and the model
made on it from the catalog's GGUF (`engines.ollama.install_model`)."""

from __future__ import annotations

import asyncio
import shlex
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from qiip_core._errors import ProvisioningError, safe_text
from qiip_core.catalog import sha256_of
from qiip_core.engines import ollama
from qiip_core.health import health_session
from qiip_core.nodes import ollama_model_key

if TYPE_CHECKING:
    from qiip_core.config import Settings
    from qiip_core.provisioning._record import TaskRecorder
    from qiip_core.provisioning._ssh import SshConnection

__all__ = ["check_own_daemon", "install_ollama_model"]

_HASHING = ThreadPoolExecutor(max_workers=2, thread_name_prefix="qiip-gguf-sha256")
"""Hashes of GGUFs (GiB each, seconds of disk) run here, not in the default executor the request path shares."""


async def check_own_daemon(ssh: SshConnection, *, host: str, root: str) -> None:
    """Check that the Ollama daemon QIIP started on the host still runs: one that could not bind its port exits,
    and whatever holds the port would be set up in its place.

    Args:
        ssh: a connection to the host.
        host: the host's name, for the error.
        root: the host's install root (`HostFacts.root`).

    Raises:
        ProvisioningError: at `health_poll`, the daemon's process is gone; the message ends with its log's last line.
    """
    pid_file = shlex.quote(f"{root}/var/run/ollama.pid")
    state = await ssh.output(
        f'p="$(cat {pid_file} 2>/dev/null)"; if [ -n "$p" ] && kill -0 "$p" 2>/dev/null; then echo running; fi',
        what="checking the Ollama daemon",
    )
    if state.strip() == "running":
        return
    log = await ssh.read_file(f"{root}/var/log/ollama-serve.log", max_bytes=64 * 1024)
    last = next((line for line in reversed(log.decode(errors="replace").splitlines()) if line.strip()), "")
    raise ProvisioningError(
        f"The Ollama daemon QIIP started on {host} has exited (its log ends: {safe_text(last, limit=200)}).",
        host=host,
        step="health_poll",
    )


async def install_ollama_model(
    settings: Settings, record: TaskRecorder, *, host: str, endpoint: str, model: str, alias: str
) -> None:
    """Push the GGUF to the setup's Ollama daemon as a blob by its SHA-256 (hashed here, hashed again by Ollama),
    make it the model named as the node's alias (`:latest` when untagged), load it and check it.

    Args:
        settings: the daemon's settings (`provisioning.model_cache_dir`, `command_timeout_s`, the allowlist).
        record: the task's record and log.
        host: the host.
        endpoint: the daemon's URL, `http://host:engine_port`.
        model: the GGUF's path inside the shared cache.
        alias: the node's model name.

    Raises:
        ProvisioningError: at `verifying`, a step of the install failed (`OllamaInstallFailed`'s line).
    """
    p = settings.provisioning
    cache = p.model_cache_dir
    assert cache is not None  # the setup was planned from the same file
    gguf = cache / model
    sha256 = await asyncio.get_running_loop().run_in_executor(_HASHING, sha256_of, gguf)
    name = ollama_model_key(alias)
    # The push is the GGUF's whole size: bounded by the remote-command deadline, not a probe's.
    session = health_session(
        policy=settings.routing.endpoint_policy(), timeout_s=p.command_timeout_s, connect_timeout_s=10.0
    )
    async with session:
        try:
            installed = await ollama.install_model(endpoint, name=name, gguf=gguf, sha256=sha256, session=session)
        except ollama.OllamaInstallFailed as exc:
            raise ProvisioningError(f"Ollama on {host}: {exc}", host=host, step="verifying") from exc
    resident = installed.resident
    record.log(
        f"Ollama made {name} from blob sha256:{sha256} ({'pushed' if installed.pushed else 'there already'}); "
        f"loaded: {resident.size_bytes / 2**20:.0f} MiB, {resident.vram_bytes / 2**20:.0f} MiB of it in GPU memory"
    )
