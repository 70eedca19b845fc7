"""The node bundle: the shell scripts shipped in `bundle/`, and the parameters they are run with.

```
bundle/lib.sh            step markers, paths under the install root, OS family, PID files
bundle/setup.sh          system_update, nvidia_driver, cuda_toolkit, vllm_install | llamacpp_install |
                         ollama_install, nfs_mount, firewall (RHEL family with dnf, Debian/Ubuntu with apt-get)
bundle/start-engine.sh   the engine in the background: PID file var/run/<engine>.pid, log var/log/<engine>-serve.log
bundle/stop-engine.sh    SIGTERM to its process group (SIGKILL after 30 s, or at once with --force); Ollama's
                         store goes with it
bundle/start-agent.sh    `qiip agent` (live GPU telemetry) in /opt/qiip-agent, run by systemd (qiip-agent.service)
```

`bundle_parameters` turns the settings into the scripts' environment and refuses, before any SSH work, a pin that
cannot be checked: the NVIDIA driver's version without its SHA-256 (the settings refuse it), llama.cpp's version
without its source digest (`engines.llamacpp`, `resolve_source`).

Every script holds the install root's lock (`flock` on `var/lib/qiip-node/bundle.lock`) for its whole run. Before
its first script, an operation runs `END_RUNS_COMMAND` (`end_previous_runs`): it ends every process group a
previous operation recorded on the host that still runs (a gateway that died leaves its run behind), then waits
for the lock, so two runs never overlap.
"""

from __future__ import annotations

import importlib.resources
import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qiip_core._errors import ConfigError, SshError
from qiip_core.config import Settings
from qiip_core.engines import ollama, vllm
from qiip_core.engines.llamacpp import SourceSpec, resolve_source
from qiip_core.nodes import Engine

if TYPE_CHECKING:
    from qiip_core.provisioning._ssh import SshConnection

__all__ = [
    "BUNDLE_FILES",
    "END_RUNS_COMMAND",
    "BundleParameters",
    "agent_settings",
    "bundle_files",
    "bundle_parameters",
    "end_previous_runs",
    "engine_script_name",
]

END_RUNS_COMMAND = r"""
root="${QIIPNODE_ROOT:-}"; root="${root%/}"; state="$root/var/lib/qiip-node"; runs="$state/runs"
for f in "$runs"/*; do
  [ -f "$f" ] || continue
  pgid="${f##*/}"
  case "$pgid" in ''|*[!0-9]*) rm -f "$f"; continue ;; esac
  [ "$pgid" = "$$" ] && continue
  if kill -0 -- "-$pgid" 2>/dev/null; then
    echo "ending=$pgid $(head -c 200 "$f" | tr -d '
')"
    kill -TERM -- "-$pgid" 2>/dev/null
    i=0; while kill -0 -- "-$pgid" 2>/dev/null && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
    kill -KILL -- "-$pgid" 2>/dev/null
    i=0; while kill -0 -- "-$pgid" 2>/dev/null && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
    kill -0 -- "-$pgid" 2>/dev/null && echo "survived=$pgid"
  fi
  rm -f "$f"
done
if [ -e "$state/bundle.lock" ] && ! flock -w "$QIIPNODE_LOCK_WAIT_S" "$state/bundle.lock" true; then
  echo "lock_held=$state/bundle.lock"
fi
"""
"""Ends the process groups earlier operations recorded on the host (TERM, KILL 5 s later) and waits up to
`QIIPNODE_LOCK_WAIT_S` for the install root's lock; prints `ending=<pgid> <tag>` per group, `survived=<pgid>` for one
that would not die, and `lock_held=<path>` when the lock stays held."""

LOCK_WAIT_S = 60
"""Seconds a bundle script waits for the install root's lock (after `end_previous_runs` freed it)."""

BUNDLE_FILES: tuple[str, ...] = ("lib.sh", "setup.sh", "start-engine.sh", "stop-engine.sh", "start-agent.sh")
"""The files uploaded to every host."""


def bundle_files() -> list[Path]:
    """The bundle's files on this machine (package data of `qiip_core.provisioning`)."""
    root = importlib.resources.files("qiip_core.provisioning") / "bundle"
    return [Path(str(root / name)) for name in BUNDLE_FILES]


def engine_script_name(engine: Engine) -> str:
    """The bundle's name for an engine: `llamacpp`, `vllm` or `ollama` (its PID file, log and install step)."""
    return {Engine.LLAMA_CPP: "llamacpp", Engine.OLLAMA: "ollama"}.get(engine, "vllm")


@dataclass(frozen=True, kw_only=True)
class BundleParameters:
    """What the bundle's scripts are run with."""

    env: dict[str, str]
    """The `QIIPNODE_*` environment of every script."""
    llamacpp_source: SourceSpec | None
    """llama.cpp's pinned source (llama.cpp setups), uploaded when the host has no build of it."""

    def command(self, script: str, *args: str, extra: Mapping[str, str] | None = None, remote_dir: str) -> str:
        """The shell command that runs `script` of the uploaded bundle with these parameters."""
        env = {**self.env, **(extra or {})}
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
        path = f'"${{QIIPNODE_ROOT:-}}"{shlex.quote(remote_dir + "/" + script)}'
        return f"env {assignments} bash {path} {' '.join(shlex.quote(a) for a in args)}".rstrip()


def agent_settings(settings: Settings) -> str:
    """The settings of a provisioned host's `qiip agent`: `QIIP_NAME=value` lines for `/etc/qiip/agent.env`
    (`QIIPNODE_AGENT_SETTINGS`), values quoted as both the shell and systemd's `EnvironmentFile` read them.

    The agent publishes to this gateway's registry backend: etcd (`provisioning.agent_etcd_endpoints`, else
    `etcd.endpoints`, and `etcd.telemetry_prefix`), or, with the embedded registry, its HTTP endpoint on every
    address at `telemetry.listen_port`, with the token file `/etc/qiip/agent.token` the gateway uploads
    (`_pipeline`).
    """
    t = settings.telemetry
    lines = {
        "QIIP_REGISTRY__BACKEND": settings.registry.backend,
        "QIIP_TELEMETRY__INTERVAL_S": f"{t.interval_s:g}",
        "QIIP_TELEMETRY__EXPIRE_AFTER_INTERVALS": str(t.expire_after_intervals),
    }
    if settings.registry.backend == "etcd":
        endpoints = settings.provisioning.agent_etcd_endpoints or settings.etcd.endpoints
        lines["QIIP_ETCD__ENDPOINTS"] = json.dumps(endpoints)
        lines["QIIP_ETCD__TELEMETRY_PREFIX"] = settings.etcd.telemetry_prefix
    else:
        lines["QIIP_TELEMETRY__LISTEN_HOST"] = "0.0.0.0"
        lines["QIIP_TELEMETRY__LISTEN_PORT"] = str(t.listen_port)
        lines["QIIP_TELEMETRY__TOKEN_FILE"] = "/etc/qiip/agent.token"
    return "\n".join(f"{name}={shlex.quote(value)}" for name, value in lines.items())


def bundle_parameters(settings: Settings, engine: Engine, *, model_alias: str) -> BundleParameters:
    """The scripts' parameters for a setup of `engine`.

    Raises:
        ConfigError: the `cuda` profile without a pinned NVIDIA driver, or llama.cpp's version without a digest.
    """
    p = settings.provisioning
    env = {
        "QIIPNODE_ENGINE": engine_script_name(engine),
        "QIIPNODE_PROFILE": p.profile,
        "QIIPNODE_ENGINE_PORT": str(p.engine_port),
        "QIIPNODE_MODEL_DIR": p.node_model_dir,
        "QIIPNODE_MODEL_ALIAS": model_alias,
        "QIIPNODE_NFS_EXPORT": p.nfs_export or "",
        "QIIPNODE_CUDA_PACKAGE": p.cuda_toolkit_package,
        **vllm.install_environment(version=p.vllm_version),
        "QIIPNODE_PIP_INDEX": p.pip_index_url,
        "QIIPNODE_LOCK_WAIT_S": str(LOCK_WAIT_S),
        # The wait for a busy package manager ends before the gateway's inactivity deadline would.
        "QIIPNODE_PACKAGE_LOCK_WAIT_S": str(max(int(p.command_idle_timeout_s) - 30, 1)),
    }
    if p.profile == "cuda":
        if p.nvidia_driver_version is None or p.nvidia_driver_sha256 is None:
            raise ConfigError(
                "The cuda profile installs a pinned NVIDIA driver: set provisioning.nvidia_driver_version and "
                "provisioning.nvidia_driver_sha256 (QIIP_PROVISIONING__NVIDIA_DRIVER_VERSION, …_SHA256)."
            )
        env.update(
            QIIPNODE_DRIVER_VERSION=p.nvidia_driver_version,
            QIIPNODE_DRIVER_SHA256=p.nvidia_driver_sha256,
            QIIPNODE_DRIVER_URL=p.nvidia_driver_url_template.format(version=p.nvidia_driver_version),
        )
    if p.telemetry_agent:
        env.update(QIIPNODE_AGENT_PACKAGE=p.agent_package, QIIPNODE_AGENT_SETTINGS=agent_settings(settings))
    if engine is Engine.OLLAMA:
        env.update(
            ollama.install_environment(
                version=p.ollama_version, sha256=p.ollama_sha256, url_template=p.ollama_url_template
            )
        )
    source = None
    if engine is Engine.LLAMA_CPP:
        source = resolve_source(settings.engines.llamacpp)
        env.update(QIIPNODE_LLAMACPP_VERSION=source.version, QIIPNODE_LLAMACPP_SHA256=source.sha256)
    return BundleParameters(env=env, llamacpp_source=source)


async def end_previous_runs(ssh: SshConnection, *, lock_wait_s: float) -> list[str]:
    """End what earlier operations left running on the host and wait for the install root's lock
    (`END_RUNS_COMMAND`).

    Args:
        ssh: a connection to the host.
        lock_wait_s: how long to wait for the lock, in seconds.

    Returns:
        One line per run ended: `process group <pgid> (<operation id> <generation> <command>)`.

    Raises:
        SshError: a run would not end, or the lock stays held (another gateway working on the host, or a process
            outside the recorded runs); or the command failed.
    """
    host = ssh.target.host
    command = f"QIIPNODE_LOCK_WAIT_S={int(max(lock_wait_s, 1))}; {END_RUNS_COMMAND}"
    out = await ssh.output(command, timeout_s=lock_wait_s + 60.0, what="ending earlier runs")
    ended: list[str] = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key == "ending":
            pgid, _, tag = value.partition(" ")
            ended.append(f"process group {pgid}" + (f" ({tag})" if tag else ""))
        elif key == "survived":
            raise SshError(f"The earlier run in process group {value} on {host} would not end (SIGKILL).", host=host)
        elif key == "lock_held":
            raise SshError(
                f"The install root's lock {value} on {host} is still held after {lock_wait_s:g} s by a process "
                "outside QIIP's recorded runs (`lslocks` on the host names it); end it and try again.",
                host=host,
            )
    return ended
