"""The setup pipeline against real OpenSSH on loopback hosts, running the real node bundle.

GPU-only commands (`nvidia-smi`, the package manager, the driver installer) are stubs printing recorded output;
vLLM, which cannot run without a GPU, is a stub server answering its API. SSH, SFTP, bash, the scripts, PID files,
process groups and the task records are real.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import asyncssh
import pytest

from qiip_core import HostBusy, HostKeyMismatch, TooManySetups
from qiip_core.lifecycle import OperationState
from qiip_core.nodes import Engine, NodeStatus
from qiip_core.provisioning import SetupRequest, TaskState
from tests.core.provisioning.conftest import Harness, provisioning_settings, until
from tests.support.sshd import DRIVER_VERSION, FakeHost, SshHosts, alive

pytestmark = pytest.mark.integration


def vllm_request(host: FakeHost) -> SetupRequest:
    return SetupRequest(hostname=host.address, engine=Engine.VLLM, model="org/model", alias="served-model")


def steps_logged(h: Harness, host: str) -> list[str]:
    return [e.msg for e in h.provisioner.logs.entries(host)]


async def written_pid(pid_file: Path) -> int:
    """The PID a host's stub wrote to `pid_file`, once written: the shell creates the file, then writes it."""
    written: list[int] = []

    def read() -> bool:
        text = pid_file.read_text() if pid_file.exists() else ""
        if text.strip().isdigit():
            written.append(int(text))
        return bool(written)

    await until(read)
    return written[0]


def kill_engine(host: FakeHost, engine: str = "vllm") -> None:
    pid = host.engine_pid(engine)
    if pid is not None and alive(pid):
        os.killpg(pid, signal.SIGKILL)


async def test_setup_installs_starts_registers_and_a_second_setup_skips_what_is_done(
    harness: Harness, ssh_hosts: SshHosts
) -> None:
    host = ssh_hosts[0]  # RHEL family: dnf
    try:
        operation = await harness.wait(await harness.provisioner.start_setup(vllm_request(host)))
        assert operation.state is OperationState.SUCCEEDED, operation.error
        task = (await harness.provisioner.tasks())[0]
        assert (task.state, task.current_step, task.failed_step) == (TaskState.SUCCEEDED, "complete", None)
        calls = host.package_manager_calls()
        assert calls[0].startswith("dnf install -y gcc-c++ cmake")
        assert "dnf install -y cuda-toolkit-12-8" in calls
        # The driver was downloaded over loopback, its digest checked, and installed: nvidia-smi reports it.
        assert (host.root / "var/lib/fake-nvidia/driver").read_text() == DRIVER_VERSION
        node = next(r.node for r in harness.registry.nodes() if r.node.id == host.address)
        assert node.managed and node.engine is Engine.VLLM and node.model == "served-model"
        assert node.endpoint == f"http://{host.address}:{harness.settings.provisioning.engine_port}"
        engine_pid = host.engine_pid("vllm")
        assert engine_pid is not None and alive(engine_pid)
        log = steps_logged(harness, host.address)
        assert "step nvidia_driver" in log and "step health_poll" in log and "step registering" in log

        teardown = await harness.wait(await harness.provisioner.start_teardown(host.address, force=False))
        assert teardown.state is OperationState.SUCCEEDED, teardown.error
        assert not alive(engine_pid) and host.engine_pid("vllm") is None
        assert harness.table.get(host.address) is None

        again = await harness.wait(await harness.provisioner.start_setup(vllm_request(host)))
        assert again.state is OperationState.SUCCEEDED, again.error
        assert host.package_manager_calls() == calls  # nothing installed twice
        log = steps_logged(harness, host.address)
        assert "system_update done: already done" in log
        assert f"nvidia_driver done: driver {DRIVER_VERSION} already installed" in log
        assert "vllm_install done: vLLM 0.26.0 already installed" in log
    finally:
        kill_engine(host)


async def test_a_step_printing_fail_fails_the_task_at_that_step_and_marks_the_node_failed(
    harness: Harness, ssh_hosts: SshHosts
) -> None:
    host = ssh_hosts[1]  # Debian: apt-get; a different driver is installed already
    host.install_driver("550.54.14")
    operation = await harness.wait(await harness.provisioner.start_setup(vllm_request(host)))
    assert operation.state is OperationState.FAILED
    assert "Step nvidia_driver failed" in (operation.error or "")
    assert "driver 550.54.14 is installed, not the pinned 580.126.09" in (operation.error or "")
    task = await harness.provisioner.store.get(host.address)
    assert task is not None and (task.state, task.failed_step) == (TaskState.FAILED, "nvidia_driver")
    assert harness.table.get(host.address).effective_node().status is NodeStatus.FAILED
    assert (
        host.package_manager_calls()[0].startswith("apt-get -o DPkg::Lock::Timeout=")
        and " update" in host.package_manager_calls()[0]
    )
    # The lease was released: the next setup of the host is not refused as busy.
    retry = await harness.wait(await harness.provisioner.start_setup(vllm_request(host)))
    assert retry.state is OperationState.FAILED


async def test_a_refused_ssh_port_fails_while_waiting_for_ssh(harness: Harness) -> None:
    request = SetupRequest(hostname="127.0.0.90", engine=Engine.VLLM, model="m", alias="m")
    operation = await harness.wait(await harness.provisioner.start_setup(request))
    assert operation.state is OperationState.FAILED
    assert "did not answer within 1 s" in (operation.error or "") and "refused" in (operation.error or "").lower()
    task = await harness.provisioner.store.get("127.0.0.90")
    assert task is not None and task.failed_step == "waiting_for_ssh"
    assert harness.table.get("127.0.0.90") is None  # never registered: nothing to mark


async def test_a_changed_host_key_is_refused_before_any_command(
    harness: Harness, ssh_hosts: SshHosts, tmp_path
) -> None:
    other = tmp_path / "other_key"
    await asyncio.to_thread(
        subprocess.run, ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True
    )
    known = tmp_path / "known_hosts"
    public = other.with_suffix(".pub").read_text().split()
    known.write_text(f"[{ssh_hosts[2].address}]:{ssh_hosts.port} {public[0]} {public[1]}\n")
    harness.provisioner.known_hosts = known
    operation = await harness.wait(await harness.provisioner.start_setup(vllm_request(ssh_hosts[2])))
    assert operation.state is OperationState.FAILED
    offered = asyncssh.read_public_key(ssh_hosts.host_key.with_suffix(".pub")).get_fingerprint()
    known_fingerprint = asyncssh.read_public_key(other.with_suffix(".pub")).get_fingerprint()
    error = operation.error or ""
    assert f"its host key changed. It offers {offered}; {known} has {known_fingerprint}." in error
    assert f"`qiip node forget-key {ssh_hosts[2].address}`" in error
    task = await harness.provisioner.store.get(ssh_hosts[2].address)
    assert task is not None and task.failed_step == "preflight"
    assert ssh_hosts[2].package_manager_calls() == []
    # The remedy: the old entry goes (and only it), then a first contact records the new key.
    known.write_text(known.read_text() + f"[127.0.0.99]:{ssh_hosts.port} {public[0]} {public[1]}\n")
    assert await harness.provisioner.forget_host_key(ssh_hosts[2].address) == 1
    assert known.read_text().startswith("[127.0.0.99]") and len(known.read_text().splitlines()) == 1


async def test_first_contact_records_the_host_key_then_holds_to_it(
    harness: Harness, ssh_hosts: SshHosts, tmp_path
) -> None:
    from qiip_core.provisioning import SshTarget, open_ssh

    known = tmp_path / "fresh_known_hosts"
    settings = harness.settings.provisioning.model_copy(update={"host_key_policy": "accept-new"})
    target = SshTarget.for_host(ssh_hosts[2].address, settings, known_hosts=known)
    async with open_ssh(target) as ssh:
        assert await ssh.output("echo hello") == "hello"
    assert ssh_hosts.host_key.with_suffix(".pub").read_text().split()[1] in known.read_text()
    strict = SshTarget.for_host(
        ssh_hosts[2].address, settings.model_copy(update={"host_key_policy": "strict"}), known_hosts=known
    )
    async with open_ssh(strict) as ssh:
        assert await ssh.output("echo again") == "again"
    public = ssh_hosts.client_key.with_suffix(".pub").read_text().split()  # another key than the host's
    known.write_text(f"[{ssh_hosts[2].address}]:{ssh_hosts.port} {public[0]} {public[1]}\n")
    with pytest.raises(HostKeyMismatch):
        async with open_ssh(target):
            pass


async def test_a_silent_step_passes_its_inactivity_deadline_and_is_stopped(
    tmp_path, ssh_hosts: SshHosts, driver_server, engine_port: int
) -> None:
    host = ssh_hosts[3]  # its package manager hangs silently (5 s leave a busy machine room to start the script)
    (host.root / "etc" / "package-manager-hangs").touch()
    settings = provisioning_settings(
        tmp_path / "state", ssh_hosts, driver_server, engine_port=engine_port, command_idle_timeout_s=5
    )
    h = Harness(settings)
    await h.registry.start(h._apply)
    try:
        operation = await h.wait(await h.provisioner.start_setup(vllm_request(host)))
        assert operation.state is OperationState.FAILED
        assert "setup.sh on 127.0.0.5 printed nothing for 5 s; it was stopped" in (operation.error or "")
        task = await h.provisioner.store.get(host.address)
        assert task is not None and task.failed_step == "system_update"
        stub_pid = int((host.root / "var/run/package-manager.pid").read_text())
        await _until_dead(stub_pid)
    finally:
        (host.root / "etc" / "package-manager-hangs").unlink()
        await h.aclose()


async def _until_dead(pid: int, timeout_s: float = 20.0) -> None:
    await until(lambda: not alive(pid), timeout_s)


async def test_cancelling_a_setup_mid_step_stops_the_remote_command_and_frees_the_host(
    harness: Harness, ssh_hosts: SshHosts
) -> None:
    host = ssh_hosts[4]
    hang = host.root / "etc" / "package-manager-hangs"
    hang.touch()
    pid_file = host.root / "var/run/package-manager.pid"
    pid_file.unlink(missing_ok=True)
    try:
        operation = await harness.provisioner.start_setup(vllm_request(host))
        stub_pid = await written_pid(pid_file)
        harness.provisioner.cancel(host.address)
        await harness.wait(operation)
        assert operation.state is OperationState.CANCELLED
        task = await harness.provisioner.store.get(host.address)
        assert task is not None and (task.state, task.failed_step) == (TaskState.CANCELLED, "system_update")
        await _until_dead(stub_pid)
        lease = await harness.provisioner.store.acquire(host.address, "op_probe")
        await lease.release()
    finally:
        hang.unlink()


async def test_two_setups_racing_for_one_host_one_is_refused_as_busy(harness: Harness, ssh_hosts: SshHosts) -> None:
    host = ssh_hosts[5]
    hang = host.root / "etc" / "package-manager-hangs"
    hang.touch()
    try:
        results = await asyncio.gather(
            harness.provisioner.start_setup(vllm_request(host)),
            harness.provisioner.start_setup(vllm_request(host)),
            return_exceptions=True,
        )
        started = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, BaseException)]
        assert len(started) == 1 and len(refused) == 1 and isinstance(refused[0], HostBusy)
        assert refused[0].status == 409
        harness.provisioner.cancel(host.address)
        await harness.wait(started[0])
    finally:
        hang.unlink()


async def test_setups_above_the_concurrency_limit_are_refused_and_teardown_is_not_limited(
    tmp_path, ssh_hosts: SshHosts, driver_server, engine_port: int
) -> None:
    settings = provisioning_settings(
        tmp_path / "state", ssh_hosts, driver_server, engine_port=engine_port, max_concurrent_setups=1
    )
    h = Harness(settings)
    await h.registry.start(h._apply)
    host = ssh_hosts[6]
    hang = host.root / "etc" / "package-manager-hangs"
    hang.touch()
    try:
        first = await h.provisioner.start_setup(vllm_request(host))
        with pytest.raises(TooManySetups) as refused:
            await h.provisioner.start_setup(vllm_request(ssh_hosts[7]))
        assert refused.value.status == 429
        h.provisioner.cancel(host.address)
        await h.wait(first)
        # A teardown of a host whose registration was lost is not counted against the limit.
        teardown = await h.wait(
            await h.provisioner.start_teardown(ssh_hosts[7].address, force=True, recovery_engine=Engine.VLLM)
        )
        assert teardown.state is OperationState.SUCCEEDED, teardown.error
    finally:
        hang.unlink()
        await h.aclose()


async def test_what_only_the_host_knows_is_checked_after_ssh_before_the_bundle(
    tmp_path, ssh_hosts: SshHosts, driver_server, engine_port: int
) -> None:
    from qiip_core import SetupInvalid

    host = ssh_hosts[6]
    absent = SetupRequest(hostname=host.address, engine=Engine.VLLM, model="/srv/hf-cache/org/model", alias="m")
    cpu = Harness(provisioning_settings(tmp_path / "cpu", ssh_hosts, driver_server, engine_port=engine_port,
                                        profile="cpu"))  # fmt: skip
    await cpu.registry.start(cpu._apply)
    try:
        for request, reason in (
            (vllm_request(host), "has an NVIDIA GPU (01:00.0 0302: 10de:20b2 (rev a1))"),
            (absent, "has no model file at /srv/hf-cache/org/model"),
        ):
            h = cpu
            operation = await h.wait(await h.provisioner.start_setup(request))
            assert operation.state is OperationState.FAILED and reason in (operation.error or ""), operation.error
            task = await h.provisioner.store.get(host.address)
            assert task is not None and task.failed_step == "preflight"
            assert h.table.get(host.address) is None  # nothing registered
        # Refused before the bundle: nothing was installed.
        assert host.package_manager_calls() == []
        with pytest.raises(SetupInvalid) as refused:
            await cpu.provisioner.start_setup(
                SetupRequest(hostname=host.address, engine=Engine.VLLM, model="-x", alias="m")
            )
        assert (refused.value.status, refused.value.param) == (400, "model")
    finally:
        await cpu.aclose()


def _lock_holder(path) -> subprocess.Popen[bytes]:
    """Another process holding the package manager's lock, as unattended upgrades do on a host that just booted."""
    path.parent.mkdir(parents=True, exist_ok=True)
    code = "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.lockf(f, fcntl.LOCK_EX); print(1, flush=True)"
    holder = subprocess.Popen([sys.executable, "-c", code + "; time.sleep(600)", str(path)], stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline()
    return holder


async def test_a_package_manager_busy_elsewhere_is_waited_for_within_the_inactivity_deadline(
    tmp_path, ssh_hosts: SshHosts, driver_server, engine_port: int
) -> None:
    host = ssh_hosts[7]  # Debian: apt-get, whose lock is dpkg's lock-frontend
    holder = _lock_holder(host.root / "var/lib/dpkg/lock-frontend")
    short = Harness(provisioning_settings(tmp_path / "short", ssh_hosts, driver_server, engine_port=engine_port,
                                          command_idle_timeout_s=31))  # fmt: skip
    await short.registry.start(short._apply)
    try:
        # An inactivity deadline of 31 s leaves 1 s to wait: the step fails, naming the holder, before the deadline.
        failed = await short.wait(await short.provisioner.start_setup(vllm_request(host)))
        assert failed.state is OperationState.FAILED
        assert f"the package manager is still busy after 1 s: process {holder.pid} holds" in (failed.error or "")
        assert host.package_manager_calls() == []
        await short.aclose()

        long = Harness(provisioning_settings(tmp_path / "long", ssh_hosts, driver_server, engine_port=engine_port))
        await long.registry.start(long._apply)
        try:
            operation = await long.provisioner.start_setup(vllm_request(host))
            waiting = f"waiting for the package manager: process {holder.pid} (python"
            await until(lambda: any(m.startswith(waiting) for m in steps_logged(long, host.address)))
            assert host.package_manager_calls() == []
            holder.kill()
            holder.wait()
            assert (await long.wait(operation)).state is OperationState.SUCCEEDED, operation.error
            assert any(m.startswith("the package manager is free after") for m in steps_logged(long, host.address))
        finally:
            await long.aclose()
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()
        kill_engine(host)


async def test_an_operation_whose_etcd_lease_is_lost_stops_and_writes_nothing_more(
    tmp_path, ssh_hosts: SshHosts, driver_server, engine_port: int, etcd
) -> None:
    from qiip_core.config import load_settings
    from qiip_core.provisioning import EtcdTaskStore, Provisioner

    host = ssh_hosts[5]
    hang = host.root / "etc" / "package-manager-hangs"
    pid_file = host.root / "var/run/package-manager.pid"
    pid_file.unlink(missing_ok=True)
    settings = provisioning_settings(tmp_path / "state", ssh_hosts, driver_server, engine_port=engine_port)
    leases = load_settings(state_dir=tmp_path, etcd={"endpoints": [etcd.url]}, provisioning={"host_lease_ttl_s": 5})
    store = EtcdTaskStore(leases, "gw-a:8080")
    h = Harness(settings)
    await h.provisioner.aclose()
    h.provisioner = Provisioner(settings, h.registry, h.table, h.operations, store=store)
    await h.registry.start(h._apply)
    hang.touch()
    try:
        operation = await h.provisioner.start_setup(vllm_request(host))
        stub_pid = await written_pid(pid_file)
        holder = await asyncio.to_thread(store._holder, host.address)
        assert holder is not None
        await asyncio.to_thread(store.revoke, holder["lease"])  # as if etcd had let it expire
        await h.wait(operation)
        # The keep-alive found the lease gone: the operation stopped with the remote command, and wrote nothing.
        assert operation.state is OperationState.FAILED and "lease of host" in (operation.error or "")
        await _until_dead(stub_pid)
        task = await store.get(host.address)
        assert task is not None and (task.state, task.current_step) == (TaskState.RUNNING, "system_update")
        assert [t.hostname for t, _ in await store.stale()] == [host.address]  # for a live gateway to adopt
    finally:
        hang.unlink()
        await h.aclose()
