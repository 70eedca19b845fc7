"""The real llmfit binary of this environment, installed and run on loopback hosts over a real OpenSSH session.

The hosts are this machine (`tests/support/sshd.py`): llmfit scores its own hardware once, and a bundled hardware
profile once, standing in for a GPU host. Its install directory lies under each host's install root.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from qiip_core import HostNotAllowed, HostNotFound, LlmfitError, LlmfitNotInstalled, RemoteTimeout, SshError
from qiip_core.config import Settings, load_settings
from qiip_core.provisioning import SshTarget, open_ssh
from qiip_core.recommendations import LLMFIT_VERSION, LlmfitBinary, Recommender, install_llmfit
from tests.support.sshd import SshHosts

pytestmark = pytest.mark.integration

GPU_PROFILE = "apple-m3-max-128gb"
"""A bundled llmfit profile with a GPU (`llmfit hardware list`), where both vLLM and llama.cpp models fit."""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    with SshHosts(tmp_path_factory.mktemp("llmfit-ssh"), 3, family="debian", gpu=False, first=40) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def binary() -> LlmfitBinary:
    return LlmfitBinary.from_environment()


def settings_for(hosts: SshHosts, state_dir: Path, **provisioning: object) -> Settings:
    values = {
        "ssh_port": hosts.port,
        "ssh_key_file": str(hosts.client_key),
        "known_hosts_file": str(hosts.known_hosts),
        "connect_timeout_s": 10,
        **provisioning,
    }
    return load_settings(state_dir=state_dir, provisioning=values)


def recommender(hosts: SshHosts, tmp_path: Path, binary: LlmfitBinary, **provisioning: object) -> Recommender:
    settings = settings_for(hosts, tmp_path / "state", **provisioning)

    def check_host(host: str) -> str:
        if not host.startswith("127."):
            raise HostNotAllowed(f"{host} is outside the allowlist.", host=host)
        return host

    return Recommender(settings, check_host=check_host, known_hosts=hosts.known_hosts, binary=binary)


def installed(hosts: SshHosts, index: int) -> Path:
    return hosts[index].root / "root" / ".cache" / "qiip" / "llmfit" / LLMFIT_VERSION / "llmfit"


def mem_total_gib() -> float:
    kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
    return kib / 1024**2


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_binary_is_the_locked_wheels(binary: LlmfitBinary) -> None:
    assert binary.version == LLMFIT_VERSION and binary.path.name == "llmfit"
    assert sha256(binary.path) == binary.sha256


def test_an_environment_without_it_says_how_to_get_it() -> None:
    with pytest.raises(LlmfitNotInstalled, match="no llmfit-absent package.*uv sync") as caught:
        LlmfitBinary.from_environment(distribution="llmfit-absent")
    assert caught.value.status == 503
    with pytest.raises(LlmfitNotInstalled, match=f"has llmfit {LLMFIT_VERSION}, not 9.9.9"):
        LlmfitBinary.from_environment(version="9.9.9")


async def test_this_machine_is_scored_over_ssh(hosts: SshHosts, tmp_path: Path, binary: LlmfitBinary) -> None:
    host = hosts[0]
    found = await recommender(hosts, tmp_path, binary).recommend(host.address, limit=5)
    assert found.host == host.address and found.profile is None
    # This machine has no GPU: llmfit scores its system memory, as /proc/meminfo gives it (KiB / 1024² = GiB).
    assert found.system.gpu_count == 0 and found.system.total_ram_gib == pytest.approx(mem_total_gib(), abs=0.01)
    assert len(found.recommendations) <= 5
    for r in found.recommendations:
        assert r.runtime in ("vllm", "llama_cpp", "mlx", "unknown") and r.run_mode == "CPU"
        assert r.memory_required_gib <= mem_total_gib()
    # Installed once, by its digest, with nothing left of the upload.
    assert sha256(installed(hosts, 0)) == binary.sha256
    assert os.access(installed(hosts, 0), os.X_OK)
    assert [p.name for p in installed(hosts, 0).parent.iterdir()] == ["llmfit"]


async def test_a_profile_stands_in_for_a_gpu_host(hosts: SshHosts, tmp_path: Path, binary: LlmfitBinary) -> None:
    found = await recommender(hosts, tmp_path, binary).recommend(hosts[1].address, profile=GPU_PROFILE, limit=12)
    assert found.profile == GPU_PROFILE and found.system.unified_memory and found.system.gpu_count == 1
    assert len(found.recommendations) == 12
    assert {"vllm", "llama_cpp"} <= {r.runtime for r in found.recommendations}
    assert {r.run_mode for r in found.recommendations} == {"GPU"}
    assert any(s.quantization for r in found.recommendations for s in r.gguf_sources)


async def test_a_second_install_reuses_and_a_corrupted_one_is_replaced(
    hosts: SshHosts, tmp_path: Path, binary: LlmfitBinary
) -> None:
    settings = settings_for(hosts, tmp_path / "state")
    host = hosts[2]
    target = SshTarget.for_host(host.address, settings.provisioning, known_hosts=hosts.known_hosts)
    async with open_ssh(target) as ssh:
        path = await install_llmfit(ssh, binary)
        assert Path(path) == installed(hosts, 2)
        first = installed(hosts, 2).stat()
        assert await install_llmfit(ssh, binary) == path
        again = installed(hosts, 2).stat()
        assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
        # One byte changed in place: the next install notices and puts a whole new file there.
        with installed(hosts, 2).open("r+b") as f:
            f.seek(4096)
            byte = f.read(1)
            f.seek(4096)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert await install_llmfit(ssh, binary) == path
    assert sha256(installed(hosts, 2)) == binary.sha256
    assert installed(hosts, 2).stat().st_ino != first.st_ino
    assert [p.name for p in installed(hosts, 2).parent.iterdir()] == ["llmfit"]


async def test_llmfit_failing_is_an_llmfit_error_with_its_reason(
    hosts: SshHosts, tmp_path: Path, binary: LlmfitBinary
) -> None:
    with pytest.raises(LlmfitError, match="exited with 1: .*unknown hardware profile 'no-such-gpu'") as caught:
        await recommender(hosts, tmp_path, binary).recommend(hosts[0].address, profile="no-such-gpu")
    assert caught.value.status == 502 and caught.value.host == hosts[0].address
    # llmfit's binary triggers the C library's weak-version note on this system: it is not the reason.
    assert "GLIBC" not in caught.value.message and "exited with 1: " in caught.value.message


def waiting_on(path: Path) -> list[int]:
    """The processes of this machine (the test hosts' too) whose command line names `path`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(path).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue  # it ended while it was listed
    return found


async def test_a_silent_llmfit_is_stopped_at_the_deadline(
    hosts: SshHosts, tmp_path: Path, binary: LlmfitBinary
) -> None:
    # A profile file that is a FIFO nobody writes: llmfit waits on it for ever.
    fifo = tmp_path / "profile.json"
    os.mkfifo(fifo)
    slow = recommender(hosts, tmp_path, binary, llmfit_timeout_s=3)
    with pytest.raises(RemoteTimeout) as caught:
        await slow.recommend(hosts[0].address, profile=str(fifo))
    assert caught.value.status == 504
    # Stopped on the host too, also when the deadline fell before the command's process group was known: nothing is
    # left waiting on the FIFO.
    async with asyncio.timeout(60):
        while waiting_on(fifo):  # noqa: ASYNC110 - a process's end on the host has no event to wait on
            await asyncio.sleep(0.1)


async def test_refusals_come_before_any_ssh(hosts: SshHosts, tmp_path: Path, binary: LlmfitBinary) -> None:
    recommend = recommender(hosts, tmp_path, binary).recommend
    with pytest.raises(HostNotAllowed):
        await recommend("10.1.2.3")
    with pytest.raises(ValueError, match="hardware profile"):
        await recommend(hosts[0].address, profile="--ram=1T")
    with pytest.raises(ValueError, match="limit"):
        await recommend(hosts[0].address, limit=0)


async def test_ssh_failing_is_an_ssh_error(hosts: SshHosts, tmp_path: Path, binary: LlmfitBinary) -> None:
    # The right port on an address sshd does not listen on: refused at once.
    with pytest.raises(SshError, match="refused") as caught:
        await recommender(hosts, tmp_path, binary).recommend("127.0.0.99")
    assert caught.value.status == 502


async def test_a_name_that_does_not_resolve_is_a_404(
    hosts: SshHosts, tmp_path: Path, binary: LlmfitBinary, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Resolving a name would ask this machine's DNS server, which is not on loopback: the resolver answers as
    # glibc does for an unknown name (EAI_NONAME), and nothing leaves the machine.
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo

    async def getaddrinfo(host: object, *args: object, **kwargs: object) -> object:
        if host == "127.gone.example":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return await real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    with pytest.raises(HostNotFound, match="127.gone.example does not resolve") as caught:
        await recommender(hosts, tmp_path, binary).recommend("127.gone.example")
    assert caught.value.status == 404 and caught.value.code == "host_not_found"


async def test_an_llmfit_flooding_its_output_is_stopped_at_the_size_cap(
    hosts: SshHosts, tmp_path: Path, binary: LlmfitBinary
) -> None:
    # A broken (or hostile) llmfit printing 40 MB of kilobyte lines, and one 40 MB line with no newline.
    flood = tmp_path / "llmfit"
    flood.write_text(
        "#!/bin/sh\nhead -c 40000000 /dev/zero | tr '\\0' x\necho\n"
        "yes \"$(head -c 1000 /dev/zero | tr '\\0' y)\" | head -n 40000\n"
    )
    flood.chmod(0o755)
    broken = LlmfitBinary(path=flood, version=binary.version, sha256=sha256(flood))
    try:
        with pytest.raises(LlmfitError, match=r"printed more than 16,777,216 bytes; it was stopped") as caught:
            await recommender(hosts, tmp_path, broken).recommend(hosts[2].address)
        assert caught.value.status == 502
    finally:
        installed(hosts, 2).unlink(missing_ok=True)  # the next test installs the real one again
