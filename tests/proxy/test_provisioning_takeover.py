"""Operations that survive their owner: the gateway killed (`kill -9`) while a setup is at each kind of step, then
restarted; and two gateways on one etcd, one killed mid-setup, the other taking its host over without a restart.

The hosts are real sshd hosts on loopback running the real node bundle; a step is held by its own command (the
remote preflight's `lspci`, the package manager, the firewall's `iptables`, the engine before it listens), so a
test waits for the step's marker in the task record, never for a duration. After the kill nothing of the old run
may be left on the host, the task says where it stopped, the host is free, and a new setup runs the bundle once.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.daemon import Daemon, free_port, wait_until
from tests.support.etcd import EtcdServer
from tests.support.provisioning import (
    TINY_SIZING,
    cpu_hosts as provisioned_cpu_hosts,
    daemon_env,
    setup_body,
    task_of,
    wait_operation,
)
from tests.support.sshd import FakeHost, SshHosts, alive

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, llama_server_binary: Path, tiny_gguf: Path) -> Iterator[SshHosts]:
    """Six Debian hosts without GPUs (127.0.0.40–45) whose llama-server a test can hold before it listens; each test
    has its own (a step a host has done is skipped the next time)."""
    yield from provisioned_cpu_hosts(
        tmp_path_factory.mktemp("takeover-ssh"),
        tmp_path_factory.mktemp("takeover-models"),
        llama_server_binary,
        tiny_gguf,
        count=6,
        first=40,
        holdable=True,
    )


def hold(host: FakeHost, what: str) -> None:
    if what == "apt-get":
        (host.root / "etc" / "package-manager-hangs").write_text("install")
    else:
        host.hold(what)


def release(host: FakeHost, what: str) -> None:
    (host.root / "etc" / "package-manager-hangs").unlink(missing_ok=True)
    host.release(what)


def held_pid(host: FakeHost, what: str) -> int | None:
    if what == "apt-get":
        path = host.root / "var" / "run" / "package-manager.pid"
        return int(path.read_text()) if path.exists() else None
    if what == "llama-server":
        return host.engine_pid("llamacpp")
    return host.held_pid(what)


def log_of(daemon: Daemon, host: str) -> list[str]:
    with daemon.admin.stream("GET", f"/admin/provisioning/{host}/logs", params={"follow": "false"}) as sse:
        return [json.loads(line[6:])["msg"] for line in sse.iter_lines() if line.startswith("data: ")]


def bundle_runs(daemon: Daemon, host: str) -> int:
    """How many times the host's log saw `setup.sh` reach its first step."""
    return sum(1 for msg in log_of(daemon, host) if msg == "step system_update")


def freed(daemon: Daemon, host: str) -> bool:
    """The takeover gave the host's lease back (its last line in the host's log)."""
    return any(msg.startswith("the host is free again by ") for msg in log_of(daemon, host))


def held_at(daemon: Daemon, host: FakeHost, step: str, what: str) -> int:
    """The PID of `what`, held on `host` while its setup is at `step`."""
    wait_until(lambda: task_of(daemon, host.address).get("current_step") == step, 60, f"step {step}")
    wait_until(lambda: held_pid(host, what) is not None, 30, f"{what} held")
    pid = held_pid(host, what)
    assert pid is not None and alive(pid)
    if step != "health_poll":
        assert host.run_groups(), f"{host.address}: the run's process group is recorded on the host"
    return pid


def taken_over(daemon: Daemon, host: FakeHost, step: str, what: str, pid: int) -> None:
    """The restarted gateway marked the setup cut at `step` failed, ended what its run left on `host` (the engine
    too, once started) and gave the host's lease back."""
    task = task_of(daemon, host.address)
    assert (task["state"], task["failed_step"]) == ("failed", step), task
    assert f"stopped during step {step} (this gateway restarted)" in task["error"]
    wait_until(lambda: not alive(pid), 60, f"the old run's {what} to end on {host.address}")
    wait_until(lambda: not host.run_groups(), 30, f"no recorded run left on {host.address}")
    wait_until(lambda: freed(daemon, host.address), 60, f"{host.address} to be free")
    if step != "preflight":  # registered as a node from the end of preflight on
        assert daemon.node_statuses().get(host.address) == "failed"


STEPS = [
    # (the step, what holds it there, index of the host)
    ("preflight", "lspci", 0),
    ("system_update", "apt-get", 1),
    ("firewall", "iptables", 2),
    ("health_poll", "llama-server", 3),
]


def test_a_gateway_killed_with_setups_at_every_step_takes_each_over_at_restart_and_the_next_setups_run_once(
    hosts: SshHosts, tmp_path: Path
) -> None:
    """One setup held at each step (`STEPS`), all at once; the gateway is killed with SIGKILL and restarted."""
    engine_port = free_port()
    for _, what, index in STEPS:
        hold(hosts[index], what)
    env = daemon_env(hosts, engine_port, QIIP_PROVISIONING__MAX_CONCURRENT_SETUPS=str(len(STEPS)))
    daemon = Daemon(tmp_path / "state", env=env).start()
    try:
        bodies = {index: setup_body(hosts[index].address, sizing=TINY_SIZING) for _, _, index in STEPS}
        for body in bodies.values():
            assert daemon.admin.post("/admin/nodes/setup", json=body).status_code == 202
        pids = {index: held_at(daemon, hosts[index], step, what) for step, what, index in STEPS}
        daemon.stop(signal.SIGKILL)
        assert all(alive(pid) for pid in pids.values()), "the gateway's death alone leaves the remote runs behind"

        daemon.start()
        for step, what, index in STEPS:
            taken_over(daemon, hosts[index], step, what, pids[index])

        for _, what, index in STEPS:
            release(hosts[index], what)
        again = {index: daemon.admin.post("/admin/nodes/setup", json=body) for index, body in bodies.items()}
        assert all(answer.status_code == 202 for answer in again.values()), [a.text for a in again.values()]
        for index, answer in again.items():
            outcome = wait_operation(daemon, answer.json()["id"])
            assert outcome["state"] == "succeeded", (outcome["error"], daemon.log()[-3000:])
            assert bundle_runs(daemon, hosts[index].address) == 1
        for index in bodies:
            teardown = daemon.admin.delete(f"/admin/nodes/{hosts[index].address}")
            assert wait_operation(daemon, teardown.json()["id"])["state"] == "succeeded"
    finally:
        for _, what, index in STEPS:
            release(hosts[index], what)
        daemon.close()


def test_a_failed_node_and_its_task_stay_failed_across_a_restart(hosts: SshHosts, tmp_path: Path) -> None:
    host = hosts[4]
    env = daemon_env(hosts, free_port(), QIIP_PROVISIONING__HEALTH_TIMEOUT_S="2")
    host.hold("llama-server")  # the engine never answers /health: the setup fails at health_poll
    try:
        with Daemon(tmp_path / "state", env=env) as daemon:
            body = setup_body(host.address, sizing=TINY_SIZING)
            answer = daemon.admin.post("/admin/nodes/setup", json=body)
            assert wait_operation(daemon, answer.json()["id"])["state"] == "failed"
            assert daemon.node_statuses().get(host.address) == "failed"
            daemon.stop()
            daemon.start()
            task = task_of(daemon, host.address)
            assert (task["state"], task["failed_step"]) == ("failed", "health_poll")
            assert daemon.node_statuses().get(host.address) == "failed"  # not unknown, then unhealthy
            host.release("llama-server")
            again = daemon.admin.post("/admin/nodes/setup", json=body)
            assert again.status_code == 202, again.text  # a failed node is set up again, not refused
            assert wait_operation(daemon, again.json()["id"])["state"] == "succeeded"
            teardown = daemon.admin.delete(f"/admin/nodes/{host.address}")
            assert wait_operation(daemon, teardown.json()["id"])["state"] == "succeeded"
    finally:
        host.release("llama-server")


def test_two_gateways_on_one_etcd_the_survivor_takes_over_a_killed_ones_setup(
    hosts: SshHosts, etcd: EtcdServer, tmp_path: Path
) -> None:
    host = hosts[5]
    engine_port = free_port()
    env = daemon_env(
        hosts,
        engine_port,
        QIIP_REGISTRY__BACKEND="etcd",
        QIIP_ETCD__ENDPOINTS=json.dumps([etcd.url]),
        QIIP_PROVISIONING__HOST_LEASE_TTL_S="5",
    )
    hold(host, "apt-get")
    with Daemon(tmp_path / "b", env=env) as survivor:
        owner = Daemon(tmp_path / "a", env=env).start()
        try:
            body = setup_body(host.address, sizing=TINY_SIZING)
            assert owner.admin.post("/admin/nodes/setup", json=body).status_code == 202
            wait_until(lambda: task_of(survivor, host.address).get("current_step") == "system_update", 60, "the step")
            wait_until(lambda: held_pid(host, "apt-get") is not None, 30, "apt-get held")
            pid = held_pid(host, "apt-get")
            assert pid is not None
            busy = survivor.admin.post("/admin/nodes/setup", json=body)
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "host_busy"
            owner.stop(signal.SIGKILL)

            # Within the lease's TTL and one reconcile pass, without any restart.
            wait_until(lambda: task_of(survivor, host.address).get("state") == "failed", 60, "the takeover")
            task = task_of(survivor, host.address)
            assert task["failed_step"] == "system_update" and "its host lease expired" in task["error"]
            wait_until(lambda: not alive(pid), 60, "the dead gateway's run to end")
            wait_until(lambda: survivor.node_statuses().get(host.address) == "failed", 30, "the node failed")
            wait_until(lambda: freed(survivor, host.address), 60, "the host to be free")
            release(host, "apt-get")
            again = survivor.admin.post("/admin/nodes/setup", json=body)
            assert again.status_code == 202, again.text
            assert wait_operation(survivor, again.json()["id"])["state"] == "succeeded"
            assert bundle_runs(survivor, host.address) == 1
            teardown = survivor.admin.delete(f"/admin/nodes/{host.address}")
            assert wait_operation(survivor, teardown.json()["id"])["state"] == "succeeded"
        finally:
            release(host, "apt-get")
            owner.close()
