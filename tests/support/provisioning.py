"""Provisioning through a real daemon: CPU hosts on loopback sshd with the project's llama-server, the daemon's
settings for them, and what the tests read back (operations, task records)."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support.daemon import Daemon, wait_until
from tests.support.hf_cache import HfCacheBuilder
from tests.support.sshd import SshHosts, alive

TINY_SIZING = {"sizing": "custom", "context_per_slot": 512, "slots": 1, "cache_type": "f16", "fit_target_mib": 64}
"""The smallest sizing of the tiny model: one slot of 512 tokens."""

TINY_REPO = "qiip-test/tiny-remote-GGUF"
"""The tiny model as a generation of the shared Hugging Face cache (setups by `artifact_id`)."""


def cpu_hosts(
    base: Path, models: Path, llama_server_binary: Path, tiny_gguf: Path, *, count: int, first: int, holdable: bool
) -> Iterator[SshHosts]:
    """`count` Debian hosts without GPUs from 127.0.0.`first` on, with the project's CPU llama-server installed
    (`holdable`: behind a wrapper a test can hold) and the shared model cache `models` (holding `tiny.gguf`);
    sshd logs every connection (`SshHosts.connections`). Their engines are killed at the end."""
    shutil.copy(tiny_gguf, models / "tiny.gguf")
    # The same model as a generation of a Hugging Face cache, for setups by artifact_id.
    HfCacheBuilder(models).add_file(TINY_REPO, "a" * 40, "tiny-Q8_0.gguf", source=tiny_gguf)
    with SshHosts(base, count, family="debian", gpu=False, first=first, log_level="VERBOSE") as hosts:
        for host in hosts.hosts:
            host.preinstall_llamacpp(llama_server_binary, holdable=holdable)
            host.share_models(models)
        hosts.models = models  # type: ignore[attr-defined]
        yield hosts
        for host in hosts.hosts:
            pid = host.engine_pid("llamacpp")
            if pid is not None and alive(pid):
                os.killpg(pid, signal.SIGKILL)


def daemon_env(hosts: SshHosts, engine_port: int, **extra: str) -> dict[str, str]:
    """A daemon's settings to set `hosts` up with the cpu profile."""
    return {
        "QIIP_PROVISIONING__PROFILE": "cpu",
        "QIIP_PROVISIONING__SSH_PORT": str(hosts.port),
        "QIIP_PROVISIONING__SSH_KEY_FILE": str(hosts.client_key),
        "QIIP_PROVISIONING__KNOWN_HOSTS_FILE": str(hosts.known_hosts),
        "QIIP_PROVISIONING__ENGINE_PORT": str(engine_port),
        "QIIP_PROVISIONING__MODEL_CACHE_DIR": str(hosts.models),  # type: ignore[attr-defined]
        "QIIP_PROVISIONING__HEALTH_INTERVAL_S": "0.2",
        "QIIP_PROVISIONING__HEALTH_TIMEOUT_S": "60",
        "QIIP_PROVISIONING__MIN_FREE_DISK_GIB": "0.01",
        "QIIP_PROVISIONING__SSH_WAIT_TIMEOUT_S": "1",
        "QIIP_PROVISIONING__MAX_CONCURRENT_SETUPS": "2",
        "QIIP_PROVISIONING__RECONCILE_INTERVAL_S": "0.5",
        **extra,
    }


def setup_body(host: str, **extra: Any) -> dict[str, Any]:
    """`POST /admin/nodes/setup` of the tiny model on `host`."""
    return {"hostname": host, "engine": "llama_cpp", "model": "tiny.gguf", "alias": "tiny-remote", **extra}


def wait_operation(daemon: Daemon, operation_id: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """The operation once it ended."""
    result: dict[str, Any] = {}

    def done() -> bool:
        result.update(daemon.admin.get(f"/admin/operations/{operation_id}").json())
        return bool(result["state"] != "running")

    wait_until(done, timeout_s, f"operation {operation_id}")
    return result


def task_of(daemon: Daemon, host: str) -> dict[str, Any]:
    """The host's task record; empty until the daemon has written it (a 202 may come first)."""
    tasks = daemon.admin.get("/admin/provisioning/tasks").json()["tasks"]
    return next((t for t in tasks if t["hostname"] == host), {})


def hang(hosts: SshHosts, index: int, on: bool) -> None:
    """Hold (or release) host `index`'s package manager, so a setup stays in `system_update`."""
    flag = hosts[index].root / "etc" / "package-manager-hangs"
    if on:
        flag.touch()
    else:
        flag.unlink(missing_ok=True)
