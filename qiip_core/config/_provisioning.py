"""The settings of provisioning over SSH (`[provisioning]`).

They are read before any remote work: a setup whose settings cannot work (a pinned driver version without its
digest) is refused before a host is contacted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from qiip_core.config._groups import PositiveSeconds, _Group

__all__ = ["ProvisioningSettings"]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")

LongSeconds = Annotated[float, Field(gt=0, le=7 * 86_400)]


class ProvisioningSettings(_Group):
    """Provisioning over SSH (`[provisioning]`): how hosts are reached and what is installed on them.

    The hosts a setup may target are the node endpoint allowlist's (`routing.allowed_endpoint_*`): the node a
    setup ends with is registered at `http://<hostname>:<engine_port>`, so a host outside it is refused before
    any power or SSH work.
    """

    ssh_port: int = Field(default=22, ge=1, le=65535)
    """The TCP port of the hosts' SSH servers."""
    ssh_user: str = Field(default="root", min_length=1, max_length=64)
    """The user the gateway logs in as; it must be root or have password-less sudo for the bundle."""
    ssh_key_file: Path | None = None
    """The private key to log in with; None uses the keys of the SSH agent (`SSH_AUTH_SOCK`). Never a password."""
    known_hosts_file: Path | None = None
    """The known-hosts file checked (and, with `host_key_policy = "accept-new"`, extended); None:
    `<state_dir>/known_hosts`."""
    host_key_policy: Literal["strict", "accept-new"] = "strict"
    """`strict`: a host whose key is not in the known-hosts file is refused. `accept-new` (first contact): a
    host with no entry is accepted and its key recorded; a host whose key changed is always refused."""
    connect_timeout_s: PositiveSeconds = 30.0
    """Deadline of one SSH connection attempt (TCP and the SSH handshake)."""
    ssh_wait_timeout_s: PositiveSeconds = 300.0
    """How long a setup waits for the host's SSH server to answer (after a power-on, a reboot)."""
    command_timeout_s: LongSeconds = 3600.0
    """Total deadline of one remote command (the setup script, the engine start)."""
    command_idle_timeout_s: PositiveSeconds = 900.0
    """Inactivity deadline of one remote command: this long without a line of output ends it."""
    llamacpp_setup_timeout_s: LongSeconds = 7200.0
    """Total deadline of the setup script for llama.cpp, which builds the engine from source."""
    llmfit_timeout_s: PositiveSeconds = 300.0
    """Deadline of one `GET /admin/nodes/{host}/recommendations`: installing llmfit on the host (a 37 MB upload
    the first time) and running `llmfit recommend --json` there."""
    max_concurrent_setups: int = Field(default=32, ge=1, le=4096)
    """Setups running at once on this gateway; one more is refused with 429 (teardowns are always allowed)."""
    host_lease_ttl_s: int = Field(default=30, ge=5, le=3600)
    """The etcd lease of a host's operation, refreshed every third of it while the operation runs: a gateway
    that dies frees its hosts this long after (plus `reconcile_interval_s`, when another gateway adopts its
    operations). An operation whose lease etcd stops confirming for this long stops."""
    reconcile_interval_s: PositiveSeconds = 5.0
    """Seconds between passes that adopt the operations of gateways that died (their tasks marked failed at the
    step they reached, their remote runs ended, their hosts freed) and restore failed nodes' status."""
    profile: Literal["cuda", "cpu"] = "cuda"
    """`cuda`: NVIDIA driver, CUDA toolkit, engines built for CUDA. `cpu`: a test profile without GPU steps,
    llama.cpp built for the CPU and planned against system memory; a host with an NVIDIA GPU refuses it."""
    engine_port: int = Field(default=8000, ge=1, le=65535)
    """The port the engine serves on; it must be in `routing.allowed_endpoint_ports` when that is not empty."""
    remote_dir: str = "/opt/qiip/bundle"
    """Where the node bundle is uploaded on the host (under its install root)."""
    model_cache_dir: Path | None = None
    """This gateway's view of the shared model cache (the NFS export the nodes mount); llama.cpp setups read
    the model's GGUF header here to plan its sizing."""
    node_model_dir: str = "/srv/hf-cache"
    """Where the nodes mount the shared model cache."""
    nfs_export: str | None = None
    """`server:/path` of the shared model cache the nodes mount (NFSv3, `soft,timeo=100,retrans=2`); None
    mounts nothing (the models must already be at `node_model_dir`)."""
    min_free_disk_gib: float = Field(default=20.0, ge=0)
    """Free disk a host needs under `/opt` (preflight)."""
    nvidia_driver_version: str | None = None
    """The pinned NVIDIA driver (`580.126.09`); a host with another driver installed fails the setup. Required
    with its `nvidia_driver_sha256` for the `cuda` profile."""
    nvidia_driver_sha256: str | None = None
    """The SHA-256 of the driver's `.run` installer; the host checks it before running the installer."""
    nvidia_driver_url_template: str = (
        "https://us.download.nvidia.com/XFree86/Linux-x86_64/{version}/NVIDIA-Linux-x86_64-{version}.run"
    )
    """Where the hosts download the driver installer; `{version}` is replaced."""
    cuda_toolkit_package: str = "cuda-toolkit-12-8"
    """The CUDA toolkit package installed from the distribution's NVIDIA repository."""
    vllm_version: str = "0.26.0"
    """The vLLM version installed in `/opt/vllm-venv`."""
    pip_index_url: str = "https://pypi.org/simple"
    """The package index the hosts install vLLM from."""
    ollama_version: str = "0.9.6"
    """The Ollama release a host set up with `engine = "ollama"` runs. With `ollama_sha256` QIIP installs it in
    `/opt/ollama/<version>` from `ollama_url_template`; without, the host's installed `ollama` must report
    exactly this version (`ollama --version`), and another is refused."""
    ollama_sha256: str | None = None
    """The SHA-256 of the release archive for `ollama_version` (its `sha256sum.txt` line); the host checks it
    before extracting. None: use the host's installed `ollama`."""
    ollama_url_template: str = "https://github.com/ollama/ollama/releases/download/v{version}/ollama-linux-{arch}.tgz"
    """Where the hosts download the Ollama release; `{version}` and `{arch}` (`amd64`, `arm64`) are replaced. A
    URL ending in `.tar.zst` (newer releases) is extracted with `zstd`, one ending in `.tgz` with `tar -z`."""
    health_timeout_s: PositiveSeconds = 600.0
    """How long a started engine may take to answer `/health`."""
    health_interval_s: PositiveSeconds = 10.0
    """Seconds between `/health` polls of a starting engine."""
    telemetry_agent: bool = False
    """Install and start `qiip agent` (live GPU telemetry) on each host set up with the `cuda` profile:
    `bundle/start-agent.sh` installs `agent_package` in `/opt/qiip-agent` and runs it as the systemd unit
    `qiip-agent.service`. It publishes as the host's name, to this gateway's registry backend."""
    agent_package: str = Field(default="qiip", min_length=1, max_length=512)
    """The pip requirement of QIIP the hosts install for the agent (`qiip==0.1.0`, or a wheel's URL), from
    `pip_index_url`."""
    agent_etcd_endpoints: list[str] = Field(default_factory=list)
    """etcd's client URLs as the hosts reach them (the agent writes its readings there); empty: `etcd.endpoints`.
    etcd authentication and TLS files are not passed to the hosts."""
    log_entries_per_host: int = Field(default=5000, ge=10)
    """Log entries kept per host (oldest dropped first)."""
    log_bytes_per_host: int = Field(default=2 * 1024 * 1024, ge=1024)
    """Log bytes kept per host (oldest entries dropped first)."""
    log_hosts: int = Field(default=256, ge=1)
    """Hosts whose logs are kept; the host whose log was written to longest ago is evicted first."""

    @field_validator("nvidia_driver_sha256", "ollama_sha256")
    @classmethod
    def _digest(cls, value: str | None) -> str | None:
        if value is not None and not _SHA256.fullmatch(value):
            raise ValueError("a SHA-256 is 64 lower-case hex digits")
        return value

    @field_validator("nvidia_driver_version", "vllm_version", "ollama_version")
    @classmethod
    def _version(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[0-9][0-9A-Za-z.+-]{0,63}", value):
            raise ValueError(f"{value!r} is not a version: digits first, then digits, letters, '.', '+' or '-'")
        return value

    @field_validator("remote_dir", "node_model_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/") or "'" in value or ".." in value.split("/"):
            raise ValueError("give an absolute path on the host, without '..' or quotes")
        return value.rstrip("/") or "/"

    @model_validator(mode="after")
    def _driver_pin(self) -> ProvisioningSettings:
        # A version without its digest would install whatever the download gives: refuse it before SSH work.
        if (self.nvidia_driver_version is None) != (self.nvidia_driver_sha256 is None):
            raise ValueError(
                "provisioning.nvidia_driver_version and provisioning.nvidia_driver_sha256 go together: a pinned "
                "driver version needs the SHA-256 of its installer"
            )
        if "{version}" not in self.nvidia_driver_url_template:
            raise ValueError("provisioning.nvidia_driver_url_template must contain {version}")
        return self

    @field_validator("ollama_url_template")
    @classmethod
    def _release_url(cls, template: str) -> str:
        # Checked here, not on the host: a template that could never download is refused at start.
        # The host replaces the literal fields alone (setup.sh), so no other brace, format spec or escape is taken.
        rest = re.sub(r"\{(?:version|arch)\}", "", template)
        if "{" in rest or "}" in rest:
            raise ValueError("it may name only {version} and {arch} in braces")
        url = urlsplit(template.replace("{version}", "0.0.0").replace("{arch}", "amd64"))
        if url.scheme not in ("https", "http") or not url.hostname:
            raise ValueError("it must be an http:// or https:// URL with a host")
        if "{version}" not in template or not url.path.endswith((".tgz", ".tar.zst")):
            raise ValueError(
                "it must contain {version} and its path end in .tgz or .tar.zst (the kinds of Ollama's release "
                "archives; releases from 0.12 on are .tar.zst)"
            )
        return template
