"""Deployments on a real daemon and real sshd hosts on loopback (the cpu profile, the project's llama-server, tiny
generated models in a shared Hugging Face cache), with the loopback QUADS stand-in and a client loop through the
gateway counting every answer that is not 200.

One daemon and six hosts serve the module's tests in order, as an operator's day: a deployment placed (with why the
other hosts were not chosen), rolled out under load, a rollout that cannot start paused and undone, a dead host
replaced, a host QUADS takes back replaced first, an unplaceable deployment explained, and a delete. Each test waits
for the state it asserts (a replica ready, a record written), never for a duration.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from qiip_core.catalog import scan_catalog
from qiip_core.engines.llamacpp import make_test_gguf
from tests.support.bad_models import LLAMA_SERVER_REFUSES, write_bad_model
from tests.support.cli import QIIP, clean_environ
from tests.support.daemon import Daemon, free_port, wait_until
from tests.support.hf_cache import HfCacheBuilder
from tests.support.provisioning import TINY_SIZING, cpu_hosts, daemon_env
from tests.support.quads import QuadsServer
from tests.support.rollouts import ClientLoop, deployment, ready_hosts, settled, status_of
from tests.support.sshd import SshHosts, alive

pytestmark = pytest.mark.integration

FIRST = 60
"""The hosts are 127.0.0.60–65: h0–h3 usable, h4 reserved in QUADS, h5 too small for the planner."""
TINY_REPO_B = "qiip-test/tiny-b-GGUF"
BROKEN_REPO = "qiip-test/refused-GGUF"


@dataclass
class Fleet:
    daemon: Daemon
    hosts: SshHosts
    quads: QuadsServer
    artifacts: dict[str, str]
    engine_port: int

    def address(self, index: int) -> str:
        return self.hosts[index].address


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, llama_server_binary: Path, tiny_gguf: Path) -> Iterator[Fleet]:
    models = tmp_path_factory.mktemp("deploy-models")
    hosts_iter = cpu_hosts(
        tmp_path_factory.mktemp("deploy-ssh"), models, llama_server_binary, tiny_gguf, count=6, first=FIRST,
        holdable=False,
    )  # fmt: skip
    hosts = next(hosts_iter)
    cache = HfCacheBuilder(models)
    other = make_test_gguf(tmp_path_factory.mktemp("deploy-b") / "tiny-b.gguf", seed=1)[0]
    cache.add_file(TINY_REPO_B, "b" * 40, "tiny-b-Q8_0.gguf", source=other)
    refused, _ = write_bad_model(tmp_path_factory.mktemp("deploy-bad") / "refused.gguf", LLAMA_SERVER_REFUSES)
    cache.add_file(BROKEN_REPO, "c" * 40, "refused-Q8_0.gguf", source=refused)
    by_repo = {g.repo_id: g.artifact_id for g in scan_catalog(models).gguf}
    artifacts = {"a": by_repo["qiip-test/tiny-remote-GGUF"], "b": by_repo[TINY_REPO_B], "bad": by_repo[BROKEN_REPO]}
    pool = [{"name": h.address, "memory_mib": 4096, "labels": {"rack": "r1"}} for h in hosts.hosts[:5]]
    pool.append({"name": hosts[5].address, "memory_mib": 32, "labels": {"rack": "r1"}})
    now = datetime.now(UTC)
    with QuadsServer(timezone="UTC") as quads:
        for host in hosts.hosts:
            quads.add_host(host.address, gpus=4)
        quads.reserve(hosts[4].address, now + timedelta(minutes=20), now + timedelta(hours=5), owner="erin")
        engine_port = free_port()
        env = daemon_env(
            hosts,
            engine_port,
            QIIP_HOSTS=json.dumps(pool),
            QIIP_QUADS__URL=quads.url,
            QIIP_QUADS__TIMEZONE="UTC",
            QIIP_QUADS__POLL_INTERVAL_S="0.3",
            QIIP_QUADS__ENFORCE_INTERVAL_S="0.3",
            QIIP_QUADS__LOOKAHEAD_S="3600",
            QIIP_QUADS__TIMEOUT_S="5",
            QIIP_DEPLOYMENTS__RECONCILE_INTERVAL_S="0.3",
            QIIP_DEPLOYMENTS__REPLACE_AFTER_S="2",
            QIIP_DEPLOYMENTS__FAILURE_BACKOFF_S="1",
            QIIP_DEPLOYMENTS__ROLLOUT_MAX_FAILURES="1",
            QIIP_PROVISIONING__MAX_CONCURRENT_SETUPS="3",
            QIIP_HEALTH__INTERVAL_S="0.3",
            QIIP_HEALTH__FAILURE_THRESHOLD="2",
        )
        with Daemon(tmp_path_factory.mktemp("deploy-state"), env=env) as daemon:
            yield Fleet(daemon, hosts, quads, artifacts, engine_port)
    for _ in hosts_iter:
        pass


SPEC: dict[str, Any] = {"name": "coder", "replicas": 3, "runtime": {"sizing": TINY_SIZING}}


def test_a_deployment_is_placed_on_fitting_hosts_and_explains_the_others(fleet: Fleet) -> None:
    spec = {**SPEC, "source": {"artifact": fleet.artifacts["a"][:10]}}
    answer = fleet.daemon.admin.put("/admin/deployments/coder", json=spec)
    assert answer.status_code == 201, answer.text
    created = answer.json()
    assert created["generation"] == 1 and created["template"]["source"]["artifact_id"] == fleet.artifacts["a"]
    wait_until(lambda: settled(fleet.daemon, "coder", 3), 240, "three ready replicas")
    placed = ready_hosts(fleet.daemon, "coder")
    assert placed <= {fleet.address(i) for i in range(4)}
    explain = fleet.daemon.admin.get("/admin/deployments/coder/explain").json()
    reasons = {h["host"]: " ".join(h["reasons"]) for h in explain["hosts"] if not h["eligible"]}
    assert "the planner says it does not fit" in reasons[fleet.address(5)], reasons
    assert "QUADS reserves it from" in reasons[fleet.address(4)] and "erin" in reasons[fleet.address(4)], reasons
    # Served through the gateway under the deployment's name, by the replicas' nodes.
    with ClientLoop(fleet.daemon.url, "coder") as loop:
        wait_until(lambda: loop.statuses.get(200, 0) >= 10, 60, "ten answers")
    assert loop.failed == 0, loop.errors
    conditions = {c["type"]: c for c in status_of(fleet.daemon, "coder")["conditions"]}
    assert conditions["Available"]["status"] and not conditions["Degraded"]["status"]


def test_a_stale_generation_and_a_broken_field_are_refused_before_anything_changes(fleet: Fleet) -> None:
    spec = {**SPEC, "source": {"artifact": fleet.artifacts["a"][:10]}, "replicas": 2}
    stale = fleet.daemon.admin.put("/admin/deployments/coder", params={"generation": 7}, json=spec)
    assert stale.status_code == 409 and "generation 1, not 7" in stale.json()["error"]["message"], stale.text
    bad = fleet.daemon.admin.put("/admin/deployments/coder", json={**spec, "placement": {"min_gpu_memory_mib": -1}})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "placement.min_gpu_memory_mib", bad.text
    unknown = fleet.daemon.admin.put("/admin/deployments/coder", json={**spec, "source": {"artifact": "0" * 12}})
    assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "source.artifact", unknown.text
    assert deployment(fleet.daemon, "coder")["generation"] == 1


def test_a_rollout_under_load_replaces_every_replica_with_no_failed_request(fleet: Fleet) -> None:
    old = deployment(fleet.daemon, "coder")["template"]["hash"]
    with ClientLoop(fleet.daemon.url, "coder") as loop:
        answer = fleet.daemon.admin.post(
            "/admin/deployments/coder/rollout", json={"source": {"artifact": fleet.artifacts["b"]}}
        )
        assert answer.status_code == 200, answer.text
        new = answer.json()["template"]["hash"]
        assert new != old and answer.json()["history"][0]["hash"] == old
        wait_until(lambda: settled(fleet.daemon, "coder", 3), 600, "the rollout to finish")
    assert loop.failed == 0, loop.errors
    events = [e["kind"] for e in status_of(fleet.daemon, "coder")["events"]]
    assert events.count("rollout") == 3 and "torn_down" in events


def test_a_rollout_that_cannot_start_pauses_and_the_old_replicas_serve_until_undone(fleet: Fleet) -> None:
    serving = deployment(fleet.daemon, "coder")["template"]["hash"]
    with ClientLoop(fleet.daemon.url, "coder") as loop:
        answer = fleet.daemon.admin.post(
            "/admin/deployments/coder/rollout", json={"source": {"artifact": fleet.artifacts["bad"]}}
        )
        assert answer.status_code == 200, answer.text

        def paused() -> bool:
            progressing = next(c for c in status_of(fleet.daemon, "coder")["conditions"] if c["type"] == "Progressing")
            return not progressing["status"] and progressing["reason"] == "RolloutPaused"

        wait_until(paused, 300, "the rollout to pause")
        assert ready_hosts(fleet.daemon, "coder", serving) and len(ready_hosts(fleet.daemon, "coder", serving)) == 3
        undone = fleet.daemon.admin.post("/admin/deployments/coder/rollout/undo", json={})
        assert undone.status_code == 200 and undone.json()["template"]["hash"] == serving, undone.text
        wait_until(lambda: settled(fleet.daemon, "coder", 3), 300, "the undo to settle")
    assert loop.failed == 0, loop.errors


def test_a_dead_replica_is_replaced_on_a_spare_host(fleet: Fleet) -> None:
    victim = sorted(ready_hosts(fleet.daemon, "coder"))[0]
    host = next(h for h in fleet.hosts.hosts if h.address == victim)
    with ClientLoop(fleet.daemon.url, "coder") as loop:
        host.refuse_ssh()
        pid = host.engine_pid("llamacpp")
        assert pid is not None and alive(pid)
        os.killpg(pid, signal.SIGKILL)
        wait_until(
            lambda: victim not in {r["host"] for r in status_of(fleet.daemon, "coder")["replicas"]},
            300,
            "the dead one gone",
        )
        wait_until(lambda: settled(fleet.daemon, "coder", 3), 300, "a replacement ready")
    assert victim not in ready_hosts(fleet.daemon, "coder")
    assert loop.failed <= 1, loop.errors  # at most the request the dead replica held
    kinds = [e["kind"] for e in status_of(fleet.daemon, "coder")["events"] if e.get("host") == victim]
    assert "replaced" in kinds, kinds
    host.authorized_keys.write_text((fleet.hosts.base / "authorized_keys").read_text())  # the host comes back


def test_a_host_quads_takes_back_is_replaced_before_its_replica_leaves(fleet: Fleet) -> None:
    reclaimed = sorted(ready_hosts(fleet.daemon, "coder"))[0]
    now = datetime.now(UTC)
    with ClientLoop(fleet.daemon.url, "coder") as loop:
        fleet.quads.reserve(reclaimed, now + timedelta(minutes=30), now + timedelta(hours=3), owner="frank")
        wait_until(
            lambda: reclaimed not in {r["host"] for r in status_of(fleet.daemon, "coder")["replicas"]}, 300, "the move"
        )
        wait_until(lambda: settled(fleet.daemon, "coder", 3), 300, "three ready again")
    assert loop.failed == 0, loop.errors
    events = status_of(fleet.daemon, "coder")["events"]
    placed = max(e["seq"] for e in events if e["kind"] == "placed")
    left = min(e["seq"] for e in events if e["kind"] == "reclaim" and e.get("host") == reclaimed)
    assert placed < left, "the replacement was placed before the reclaimed replica was taken away"


def test_a_deployment_no_host_can_hold_is_degraded_with_each_hosts_reason(fleet: Fleet) -> None:
    spec = {"name": "big", "source": {"artifact": fleet.artifacts["a"][:12]}, "placement": {"labels": {"gpu": "h100"}}}
    assert fleet.daemon.admin.put("/admin/deployments/big", json=spec).status_code == 201

    def degraded() -> bool:
        condition = next(
            (c for c in status_of(fleet.daemon, "big").get("conditions", []) if c["type"] == "Degraded"), None
        )
        return condition is not None and condition["reason"] == "NoFittingHost"

    wait_until(degraded, 60, "Degraded NoFittingHost")
    explain = fleet.daemon.admin.get("/admin/deployments/big/explain").json()
    assert all(not h["eligible"] for h in explain["hosts"])
    assert all(any("label gpu" in r or "busy" in r or "QUADS" in r for r in h["reasons"]) for h in explain["hosts"])
    assert status_of(fleet.daemon, "big")["replicas"] == []
    assert fleet.daemon.admin.delete("/admin/deployments/big").status_code == 202
    wait_until(lambda: fleet.daemon.admin.get("/admin/deployments/big").status_code == 404, 60, "big removed")


def test_a_lost_state_directory_restored_from_a_backup_resumes_the_deployment_on_its_replicas(
    fleet: Fleet, tmp_path: Path
) -> None:
    wait_until(lambda: settled(fleet.daemon, "coder", 3), 300, "three ready replicas")
    hosts = ready_hosts(fleet.daemon, "coder")
    answer = fleet.daemon.admin.get("/admin/state/backup")
    assert answer.status_code == 200 and "attachment" in answer.headers["content-disposition"]
    backup = tmp_path / "fleet.json"
    backup.write_bytes(answer.content)
    records = {t["hostname"]: t["started_at"] for t in json.loads(answer.content)["kinds"]["provisioning"]}
    fleet.daemon.stop()
    # The disk is lost: every document of the state directory goes (the replicas keep running on their hosts).
    for name in ("nodes", "deployments", "deployment-status", "hosts", "provisioning", "tokens"):
        (fleet.daemon.state_dir / f"{name}.json").unlink(missing_ok=True)
    done = subprocess.run(
        [*QIIP, "state", "restore", str(backup)], env=clean_environ() | fleet.daemon.env, capture_output=True, text=True
    )
    assert done.returncode == 0 and "restored into embedded" in done.stdout, done.stdout + done.stderr
    fleet.daemon.start()
    wait_until(lambda: settled(fleet.daemon, "coder", 3), 300, "three ready replicas again")
    # Adopted, not recreated: the same hosts, and no setup ran again on any of them.
    assert ready_hosts(fleet.daemon, "coder") == hosts
    tasks = {t["hostname"]: t for t in fleet.daemon.admin.get("/admin/provisioning/tasks").json()["tasks"]}
    assert all(tasks[h]["started_at"] == records[h] for h in hosts), (tasks, records)
    # The running daemon answers a dry run of the same file: nothing to refuse.
    plan = fleet.daemon.admin.post(
        "/admin/state/restore",
        params={"dry_run": "true", "replace": "true"},
        content=backup.read_bytes(),
        headers={"content-type": "application/json"},
    )
    assert plan.status_code == 200 and plan.json()["dry_run"] and plan.json()["refused"] is None, plan.text
    bad = fleet.daemon.admin.post("/admin/state/restore", content=b"{}", headers={"content-type": "application/json"})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_backup", bad.text


def test_deleting_drains_and_tears_down_every_replica(fleet: Fleet) -> None:
    hosts = ready_hosts(fleet.daemon, "coder")
    assert fleet.daemon.admin.delete("/admin/deployments/coder").status_code == 202
    wait_until(lambda: fleet.daemon.admin.get("/admin/deployments/coder").status_code == 404, 300, "coder removed")
    nodes = {n["id"] for n in fleet.daemon.admin.get("/admin/nodes").json()["nodes"] if n.get("engine")}
    assert not hosts & nodes
    for host in fleet.hosts.hosts:
        if host.address in hosts:
            pid = host.engine_pid("llamacpp")
            assert pid is None or not alive(pid), f"{host.address}'s engine still runs"
    log = fleet.daemon.log()
    assert "Traceback" not in log and "a deployment pass failed" not in log, log[-4000:]
