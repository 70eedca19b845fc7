"""Several SSH hosts on loopback for provisioning tests: one real OpenSSH `sshd` listening on 127.0.0.2 and up.

Each address stands for one host with its own install root (`QIIPNODE_ROOT`, set by sshd's `Match LocalAddress`
with `SetEnv`), its own engine listen address (`QIIPNODE_BIND`) and its own PATH, whose first directory holds stub
executables for what only a GPU host has: `nvidia-smi`, the package manager (`dnf` or `apt-get`). They print
output recorded from real hosts; the NVIDIA driver installer (served over loopback HTTP by `DriverServer`) is a
shell script that "installs" the driver the `nvidia-smi` stub then reports. Everything else runs for real: bash,
the bundle's scripts, setsid, sha256sum, curl, SFTP, llama-server.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from qiip_core.engines.llamacpp._source import PINNED_SHA256
from tests.support.daemon import free_port, stop_process
from tests.support.files import LoopbackFileServer

DRIVER_VERSION = "580.126.09"
GPU_LINE = "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-4f1c2b8e-1d7a-6c55-9a0e-2f3b9d8c7e61)"
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
    "NVIDIA driver is installed and running."
)

_NVIDIA_SMI = f"""#!/bin/bash
# nvidia-smi as a host with one A100 answers (output recorded from driver 580.126.09).
state="$QIIPNODE_ROOT/var/lib/fake-nvidia/driver"
if [[ ! -f "$state" ]]; then echo "{NO_DRIVER}"; exit 9; fi
case "$*" in
  -L) echo "{GPU_LINE}" ;;
  *driver_version*) cat "$state"; echo ;;
  *memory.free*) echo "0, NVIDIA A100-SXM4-80GB, 81920, 81050" ;;
  *) echo "NVIDIA-SMI $(cat "$state")" ;;
esac
"""

_PACKAGE_MANAGER = """#!/bin/bash
# {name} as it answers on a host whose repositories hold every package asked for (output recorded). Like the real
# one, it refuses to run while another process holds its lock (an unattended upgrade on a host that just booted).
echo "{name} $*" >>"$QIIPNODE_ROOT/var/log/package-manager.calls"
lock="$QIIPNODE_ROOT/{lock}"
mkdir -p "$(dirname "$lock")"
try_lock='import fcntl, sys; fcntl.lockf(open(sys.argv[1], "a"), fcntl.LOCK_EX | fcntl.LOCK_NB)'
if ! python3 -c "$try_lock" "$lock" 2>/dev/null; then
  echo "E: Could not get lock $lock. It is held by another process" >&2
  exit 100
fi
hang="$QIIPNODE_ROOT/etc/package-manager-hangs"
if [[ -f "$hang" && ( ! -s "$hang" || "$*" == *"$(cat "$hang")"* ) ]]; then
  echo $$ >"$QIIPNODE_ROOT/var/run/package-manager.pid"
  sleep 600
fi
{output}
exit 0
"""
_LOCKS = {"dnf": "var/lib/rpm/.rpm.lock", "apt-get": "var/lib/dpkg/lock-frontend"}

_HELD = """#!/bin/bash
# {name} as the host has it, held while $QIIPNODE_ROOT/etc/hold/{name} exists (a test stops a step there); its PID
# is in $QIIPNODE_ROOT/var/run/held-{name}.pid while it waits.
if [[ -e "$QIIPNODE_ROOT/etc/hold/{name}" ]]; then
  mkdir -p "$QIIPNODE_ROOT/var/run"
  echo $$ >"$QIIPNODE_ROOT/var/run/held-{name}.pid"
  while [[ -e "$QIIPNODE_ROOT/etc/hold/{name}" ]]; do sleep 0.05; done
fi
{body}
"""
_LSPCI_GPU = 'echo "01:00.0 0302: 10de:20b2 (rev a1)"'
_LSPCI_CPU = 'echo "00:02.0 0300: 8086:46a6 (rev 0c)"'
_IPTABLES = 'echo "iptables $*" >>"$QIIPNODE_ROOT/var/log/iptables.calls"'

_HELD_ENGINE = """#!/bin/bash
# llama-server, started only once {root}/etc/hold/llama-server is gone (a test holds a setup in health_poll). The
# bundle keeps its QIIPNODE_* settings out of the engine's environment, so the install root is written in here.
while [[ -e "{root}/etc/hold/llama-server" ]]; do sleep 0.05; done
exec {binary} "$@"
"""
_DNF_OUTPUT = 'echo "Last metadata expiration check: 0:12:41 ago."; echo "Dependencies resolved."; echo "Complete!"'
_APT_OUTPUT = (
    'echo "Reading package lists..."; echo "Building dependency tree..."; echo "Reading state information..."; '
    'echo "0 upgraded, 0 newly installed, 0 to remove and 0 not upgraded."'
)

DRIVER_INSTALLER = f"""#!/bin/sh
# The NVIDIA installer's effect, as nvidia-smi sees it: the pinned driver is loaded.
mkdir -p "$QIIPNODE_ROOT/var/lib/fake-nvidia"
printf '%s' "{DRIVER_VERSION}" >"$QIIPNODE_ROOT/var/lib/fake-nvidia/driver"
echo "Installation of the NVIDIA Accelerated Graphics Driver for Linux-x86_64"
echo "(version: {DRIVER_VERSION}) is now complete."
"""

_FAKE_VLLM = """#!{python}
# vLLM's OpenAI server as the gateway sees it (vLLM cannot run without a GPU): /health and /v1/models.
import http.server, json, sys
args = sys.argv[1:]
def opt(name):
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise SystemExit(f"no {{name}}")
alias = opt("--served-model-name")
assert args[-2] == "--", args  # the model comes last, after --
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        models = {{"object": "list", "data": [{{"id": alias, "object": "model"}}]}}
        body = b"" if self.path == "/health" else json.dumps(models).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
print("INFO: vLLM API server version 0.26.0", flush=True)
http.server.ThreadingHTTPServer((opt("--host"), int(opt("--port"))), H).serve_forever()
"""


def _write(path: Path, text: str, mode: int = 0o755) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


class FakeHost:
    """One loopback host: its address, install root and stub directory."""

    def __init__(self, address: str, base: Path, *, family: str, gpu: bool) -> None:
        self.address = address
        self.root = base / address
        self.bin = self.root / "stub-bin"
        self.family = family
        self.gpu = gpu
        os_release = (
            'ID="rhel"\nID_LIKE="fedora"\nVERSION_ID="9.4"\n' if family == "rhel" else 'ID=debian\nVERSION_ID="12"\n'
        )
        _write(self.root / "etc" / "os-release", os_release, 0o644)
        (self.root / "opt").mkdir(parents=True, exist_ok=True)
        name = "dnf" if family == "rhel" else "apt-get"
        output = _DNF_OUTPUT if family == "rhel" else _APT_OUTPUT
        _write(self.bin / name, _PACKAGE_MANAGER.format(name=name, output=output, lock=_LOCKS[name]))
        if gpu:
            _write(self.bin / "nvidia-smi", _NVIDIA_SMI)
        _write(self.bin / "lspci", _HELD.format(name="lspci", body=_LSPCI_GPU if gpu else _LSPCI_CPU))
        # Never the machine's own firewall: the step's command is a stub that records its calls.
        _write(self.bin / "iptables", _HELD.format(name="iptables", body=_IPTABLES))

    def path_env(self) -> str:
        return f"{self.bin}:/usr/local/bin:/usr/bin:/bin"

    @property
    def authorized_keys(self) -> Path:
        """The keys sshd accepts for this host alone (`AuthorizedKeysFile` in its `Match` block)."""
        return self.root / "etc" / "ssh" / "authorized_keys"

    def refuse_ssh(self) -> None:
        """From now on, sshd refuses every login to this host (as a host whose sshd is down would be unusable)."""
        self.authorized_keys.unlink(missing_ok=True)

    def hold(self, name: str) -> None:
        """Hold the next run of `name` (`lspci`, `iptables`, `llama-server`) until `release(name)`."""
        (self.root / "etc" / "hold").mkdir(parents=True, exist_ok=True)
        (self.root / "etc" / "hold" / name).touch()

    def release(self, name: str) -> None:
        (self.root / "etc" / "hold" / name).unlink(missing_ok=True)

    def held_pid(self, name: str) -> int | None:
        """The PID of the held `name`, once it waits."""
        path = self.root / "var" / "run" / f"held-{name}.pid"
        return int(path.read_text()) if path.exists() else None

    def run_groups(self) -> list[int]:
        """The process groups operations recorded on the host that still have a live process."""
        runs = self.root / "var" / "lib" / "qiip-node" / "runs"
        found = []
        for entry in runs.iterdir() if runs.is_dir() else ():
            if entry.name.isdigit():
                try:
                    os.killpg(int(entry.name), 0)
                except ProcessLookupError:
                    continue
                except PermissionError:
                    pass
                found.append(int(entry.name))
        return found

    def package_manager_calls(self) -> list[str]:
        path = self.root / "var" / "log" / "package-manager.calls"
        return path.read_text().splitlines() if path.exists() else []

    def install_driver(self, version: str) -> None:
        _write(self.root / "var" / "lib" / "fake-nvidia" / "driver", version, 0o644)

    def preinstall_llamacpp(self, server_binary: Path, *, version: str = "0.3.36", holdable: bool = False) -> None:
        """The project's CPU build of llama-server as the bundle installs it (`/opt/llama.cpp/<version>-cpu`);
        `holdable`: behind a wrapper that waits while `hold("llama-server")`."""
        prefix = self.root / "opt" / "llama.cpp" / f"{version}-cpu"
        (prefix / "bin").mkdir(parents=True, exist_ok=True)
        link = prefix / "bin" / "llama-server"
        if holdable:
            _write(link, _HELD_ENGINE.format(binary=server_binary, root=self.root))
        elif not link.exists():
            link.symlink_to(server_binary)
        (prefix / ".qiip-source-sha256").write_text(PINNED_SHA256[("pypi-sdist", version)])

    def preinstall_vllm(self, version: str = "0.26.0") -> None:
        venv = self.root / "opt" / "vllm-venv"
        _write(venv / "bin" / "vllm", _FAKE_VLLM.format(python=sys.executable))
        (venv / ".qiip-vllm-version").write_text(version)

    def preinstall_ollama(self, version: str) -> None:
        """An `ollama` of release `version` on the host's PATH, as a host set up by hand has it (the stand-in)."""
        from tests.support.ollama import executable

        _write(self.bin / "ollama", executable(version))

    def share_models(self, model_dir: Path, node_model_dir: str = "/srv/hf-cache") -> None:
        link = self.root / node_model_dir.lstrip("/")
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(model_dir)

    def engine_pid(self, engine: str) -> int | None:
        path = self.root / "var" / "run" / f"{engine}.pid"
        return int(path.read_text()) if path.exists() else None


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie); it may end between any two reads of /proc."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "zombie" not in status.lower()


class SshHosts:
    """One sshd serving `FakeHost`s on 127.0.0.2, 127.0.0.3, …; a client key and a known-hosts file for them.

    Args:
        base: a directory of its own.
        count: how many hosts.
        family: `rhel` or `debian` for every host, or None to alternate (even indexes rhel).
        gpu: give the hosts the `nvidia-smi` stub.
        first: the last octet of the first address.
        log_level: sshd's `LogLevel`; `VERBOSE` logs each connection (`connections()` counts them).
    """

    def __init__(
        self,
        base: Path,
        count: int,
        *,
        family: str | None = None,
        gpu: bool = True,
        first: int = 2,
        log_level: str = "ERROR",
    ) -> None:
        self.base = base
        self.log_level = log_level
        self.port = free_port()
        self.hosts = [
            FakeHost(
                f"127.0.0.{first + i}",
                base / "hosts",
                family=family or ("rhel" if i % 2 == 0 else "debian"),
                gpu=gpu,
            )
            for i in range(count)
        ]
        self.host_key = base / "ssh_host_ed25519_key"
        self.client_key = base / "client_ed25519"
        self.known_hosts = base / "known_hosts"
        self.process: subprocess.Popen[bytes] | None = None

    def __getitem__(self, index: int) -> FakeHost:
        return self.hosts[index]

    def start(self) -> SshHosts:
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not Path(sshd).exists():
            raise RuntimeError("sshd is not installed; `scripts/setup --test` installs the openssh-server package")
        for key in (self.host_key, self.client_key):
            if not key.exists():
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        authorized = self.base / "authorized_keys"
        authorized.write_text(self.client_key.with_suffix(".pub").read_text())
        lines = [
            f"Port {self.port}",
            *(f"ListenAddress {h.address}" for h in self.hosts),
            f"HostKey {self.host_key}",
            f"AuthorizedKeysFile {authorized}",
            f"PidFile {self.base / 'sshd.pid'}",
            "UsePAM no",
            "StrictModes no",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "Subsystem sftp internal-sftp",
            "MaxStartups 500",
            "MaxSessions 200",
            f"LogLevel {self.log_level}",
        ]
        for host in self.hosts:
            host.authorized_keys.parent.mkdir(parents=True, exist_ok=True)
            host.authorized_keys.write_text(authorized.read_text())
            lines += [
                f"Match LocalAddress {host.address}",
                f"  SetEnv QIIPNODE_ROOT={host.root} QIIPNODE_BIND={host.address} PATH={host.path_env()}"
                f" OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'active')}",
                f"  AuthorizedKeysFile {host.authorized_keys}",
            ]
        config = self.base / "sshd_config"
        config.write_text("\n".join(lines) + "\n")
        Path("/run/sshd").mkdir(exist_ok=True)
        log = (self.base / "sshd.log").open("ab")
        self.process = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.write_known_hosts()
        self._wait_ready()
        return self

    def connections(self, address: str | None = None) -> int:
        """TCP connections sshd accepted so far (with `log_level="VERBOSE"`), to `address` or to any host."""
        log = (self.base / "sshd.log").read_text(errors="replace")
        return sum(
            1
            for line in log.splitlines()
            if "Connection from " in line and (address is None or f" on {address} port " in line)
        )

    def write_known_hosts(self, key: Path | None = None) -> None:
        public = (key or self.host_key).with_suffix(".pub").read_text().split()
        self.known_hosts.write_text("".join(f"[{h.address}]:{self.port} {public[0]} {public[1]}\n" for h in self.hosts))

    def _wait_ready(self) -> None:
        import socket

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.base / 'sshd.log').read_text()}")
            try:
                with socket.create_connection((self.hosts[-1].address, self.port), timeout=1) as sock:
                    if sock.recv(64).startswith(b"SSH-"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("sshd did not start")

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, timeout_s=10)

    def __enter__(self) -> SshHosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class DriverServer:
    """The NVIDIA driver installer served over loopback HTTP (`provisioning.nvidia_driver_url_template`)."""

    def __init__(self, base: Path) -> None:
        self.directory = base / "driver-mirror"
        installer = _write(self.directory / f"NVIDIA-Linux-x86_64-{DRIVER_VERSION}.run", DRIVER_INSTALLER)
        self.sha256 = hashlib.sha256(installer.read_bytes()).hexdigest()
        self.files = LoopbackFileServer(self.directory)
        self.url_template = f"{self.files.url}/NVIDIA-Linux-x86_64-{{version}}.run"

    def __enter__(self) -> DriverServer:
        self.files.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.files.__exit__(*exc)
