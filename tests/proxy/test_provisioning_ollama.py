"""Ollama set up on a host by QIIP, through the daemon, on loopback SSH hosts.

Each host's `ollama` is the Ollama stand-in run as the binary (`tests.support.ollama.executable`): installed by hand
(on the host's PATH) or downloaded by the bundle from a pinned release served on loopback
(`OllamaReleaseServer`). The model is the tiny GGUF of the shared cache, pushed to the daemon as a blob by its
SHA-256 and made its model; clients then use it through the gateway's OpenAI routes.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from qiip_core.catalog import scan_catalog
from tests.support.daemon import Daemon, free_port, wait_until
from tests.support.hf_cache import HfCacheBuilder
from tests.support.ollama import OllamaReleaseServer, OllamaStandIn
from tests.support.provisioning import TINY_REPO, TINY_SIZING, daemon_env, task_of, wait_operation
from tests.support.rollouts import ClientLoop, deployment, ready_hosts, settled
from tests.support.sshd import SshHosts, alive

pytestmark = pytest.mark.integration

VERSION = "0.9.6"
"""The release the settings pin (`provisioning.ollama_version`'s default)."""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Iterator[SshHosts]:
    """Four Debian hosts without GPUs (127.0.0.110–113): the first and last with Ollama 0.9.6 installed by hand, the
    second with none, the third with 0.5.1; the shared model cache holds the tiny GGUF."""
    models = tmp_path_factory.mktemp("ollama-models")
    (models / "tiny.gguf").write_bytes(tiny_gguf.read_bytes())
    HfCacheBuilder(models).add_file(TINY_REPO, "a" * 40, "tiny-Q8_0.gguf", source=tiny_gguf)
    base = tmp_path_factory.mktemp("ollama-ssh")
    with SshHosts(base, 4, family="debian", gpu=False, first=110, log_level="VERBOSE") as found:
        found[0].preinstall_ollama(VERSION)
        found[2].preinstall_ollama("0.5.1")
        found[3].preinstall_ollama(VERSION)
        found.models = models  # type: ignore[attr-defined]
        yield found
        for host in found.hosts:
            pid = host.engine_pid("ollama")
            if pid is not None and alive(pid):
                os.killpg(pid, signal.SIGKILL)


def body(host: str, **extra: Any) -> dict[str, Any]:
    """`POST /admin/nodes/setup` of the tiny model on `host` with Ollama."""
    return {
        "hostname": host,
        "engine": "ollama",
        "model": "tiny.gguf",
        "alias": "tiny-ollama",
        "sizing": TINY_SIZING,
        **extra,
    }


def entries(daemon: Daemon, host: str) -> list[dict[str, Any]]:
    """The host's provisioning log."""
    with daemon.admin.stream("GET", f"/admin/provisioning/{host}/logs", params={"follow": "false"}) as sse:
        return [json.loads(line[6:]) for line in sse.iter_lines() if line.startswith("data: ")]


def store(hosts: SshHosts, index: int) -> Path:
    """QIIP's Ollama store on a host (never the host's own /var/lib/ollama)."""
    return hosts[index].root / "var" / "lib" / "qiip-node" / "ollama"


def test_an_ollama_setup_serves_its_pushed_model_then_teardown_frees_the_store(hosts: SshHosts, tmp_path: Path) -> None:
    host, port = hosts[0], free_port()
    # The host's own Ollama store, where hand-made installs keep it: QIIP's daemon never uses it, teardown keeps it.
    own = host.root / "var" / "lib" / "ollama" / "models" / "blobs" / "sha256-hosts-own"
    own.parent.mkdir(parents=True, exist_ok=True)
    own.write_text("the host's model")
    with Daemon(tmp_path / "state", env=daemon_env(hosts, port)) as daemon:
        artifact = next(g.artifact_id for g in scan_catalog(hosts.models).gguf if g.repo_id == TINY_REPO)  # type: ignore[attr-defined]
        setup = body(host.address, artifact_id=artifact)
        del setup["model"]
        answer = daemon.admin.post("/admin/nodes/setup", json=setup)
        assert answer.status_code == 202, answer.text
        operation = wait_operation(daemon, answer.json()["task_id"])
        assert operation["state"] == "succeeded", (operation["error"], daemon.log()[-3000:])
        node = operation["result"]["node"]
        assert (node["engine"], node["model"], node["managed"], node["artifact_id"]) == (
            "ollama",
            "tiny-ollama",
            True,
            artifact,
        )
        daemon.wait_status(host.address, "healthy", timeout_s=30)
        assert task_of(daemon, host.address)["current_step"] == "complete"

        with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0) as client:
            completion = client.chat.completions.create(
                model="tiny-ollama", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert completion.choices[0].message.content

        log = entries(daemon, host.address)
        messages = [e["msg"] for e in log]
        assert f"ollama_install done: Ollama {VERSION} found installed at {host.bin}/ollama" in messages
        sha = hashlib.sha256((hosts.models / "tiny.gguf").read_bytes()).hexdigest()  # type: ignore[attr-defined]
        assert any(m.startswith(f"Ollama made tiny-ollama:latest from blob sha256:{sha} (pushed)") for m in messages)
        assert any("not verified against Ollama's allocator" in m for m in messages)
        # The daemon is QIIP's: its port, its store under the install root, the planned slots and context, no cloud.
        serve_log = (host.root / "var" / "log" / "ollama-serve.log").read_text()
        for setting in (
            f"OLLAMA_HOST:{host.address}:{port}",
            f"OLLAMA_MODELS:{host.root}/var/lib/qiip-node/ollama/models",
            "OLLAMA_NUM_PARALLEL:1",
            "OLLAMA_CONTEXT_LENGTH:512",
            "OLLAMA_KEEP_ALIVE:-1",
            "OLLAMA_NO_CLOUD:1",
        ):
            assert setting in serve_log
        assert (store(hosts, 0) / "models" / "blobs" / f"sha256-{sha}").is_file()
        view = daemon.admin.get(f"/admin/nodes/{host.address}").json()
        assert [m["name"] for m in view["resident"]] == ["tiny-ollama:latest"]

        engine_pid = host.engine_pid("ollama")
        assert engine_pid is not None and alive(engine_pid)
        teardown = daemon.admin.delete(f"/admin/nodes/{host.address}")
        assert teardown.status_code == 202, teardown.text
        assert wait_operation(daemon, teardown.json()["id"])["state"] == "succeeded"
        daemon.wait_gone(host.address)
        assert not alive(engine_pid)
        assert not store(hosts, 0).exists()
        assert own.read_text() == "the host's model"


def test_the_pinned_release_is_installed_only_with_its_sha256(hosts: SshHosts, tmp_path: Path) -> None:
    host = hosts[1]
    with OllamaReleaseServer(tmp_path, version=VERSION) as release:
        pinned = {"QIIP_PROVISIONING__OLLAMA_URL_TEMPLATE": release.url_template}
        wrong = "0" * 64
        env = daemon_env(hosts, free_port(), QIIP_PROVISIONING__OLLAMA_SHA256=wrong, **pinned)
        with Daemon(tmp_path / "state", env=env) as daemon:
            answer = daemon.admin.post("/admin/nodes/setup", json=body(host.address))
            operation = wait_operation(daemon, answer.json()["task_id"])
            assert operation["state"] == "failed"
            task = task_of(daemon, host.address)
            assert task["failed_step"] == "ollama_install"
            assert f"the release archive's sha256 is {release.sha256}, not the pinned {wrong}" in task["error"]
            assert not (host.root / "opt" / "ollama").exists() or not any((host.root / "opt" / "ollama").iterdir())
            assert host.engine_pid("ollama") is None

        env = daemon_env(hosts, free_port(), QIIP_PROVISIONING__OLLAMA_SHA256=release.sha256, **pinned)
        with Daemon(tmp_path / "state", env=env) as daemon:
            answer = daemon.admin.post("/admin/nodes/setup", json=body(host.address))
            operation = wait_operation(daemon, answer.json()["task_id"])
            assert operation["state"] == "succeeded", (operation["error"], daemon.log()[-3000:])
            prefix = host.root / "opt" / "ollama" / VERSION
            assert (prefix / ".qiip-ollama-sha256").read_text() == release.sha256
            assert f"ollama_install done: Ollama {VERSION} installed from its pinned release" in [
                e["msg"] for e in entries(daemon, host.address)
            ]
            daemon.wait_status(host.address, "healthy", timeout_s=30)
            teardown = daemon.admin.delete(f"/admin/nodes/{host.address}")
            assert wait_operation(daemon, teardown.json()["id"])["state"] == "succeeded"


def test_an_installed_ollama_of_another_version_is_refused_in_one_line(hosts: SshHosts, tmp_path: Path) -> None:
    host = hosts[2]
    with Daemon(tmp_path / "state", env=daemon_env(hosts, free_port())) as daemon:
        answer = daemon.admin.post("/admin/nodes/setup", json=body(host.address))
        assert wait_operation(daemon, answer.json()["task_id"])["state"] == "failed"
        task = task_of(daemon, host.address)
        assert task["failed_step"] == "ollama_install"
        assert (
            f"the installed {host.bin}/ollama is version 0.5.1, not the pinned {VERSION} (provisioning.ollama_version"
            in task["error"]
        )
        assert "\n" not in task["error"]
        assert host.engine_pid("ollama") is None


def test_bad_input_is_refused_before_any_ssh_connection(hosts: SshHosts, tmp_path: Path) -> None:
    host = hosts[3].address
    with Daemon(tmp_path / "state", env=daemon_env(hosts, free_port())) as daemon:
        before = hosts.connections()
        for bad, field, reason in (
            ({k: v for k, v in body(host).items() if k != "alias"}, "alias", "it does not default to the model's path"),
            (body(host) | {"alias": "tiny;reboot"}, "alias", "the model's name on Ollama"),
            (body(host) | {"alias": "a:b:c"}, "alias", "the model's name on Ollama"),
            (body(host) | {"model": "/srv/hf-cache/tiny.gguf"}, "model", "a GGUF's path inside the shared model cache"),
            (body(host) | {"model": "missing.gguf"}, "model", "is not a file in the shared model cache"),
        ):
            answer = daemon.admin.post("/admin/nodes/setup", json=bad)
            assert answer.status_code == 400, (bad, answer.text)
            error = answer.json()["error"]
            assert error["param"] == field and reason in error["message"], (bad, error)
        assert hosts.connections() == before
        assert daemon.admin.get("/admin/provisioning/tasks").json()["tasks"] == []


def test_a_gateway_killed_while_it_pushes_the_model_stops_the_daemon_and_frees_the_store_at_restart(
    hosts: SshHosts, tmp_path: Path
) -> None:
    host = hosts[3]
    host.hold("ollama-create")
    try:
        daemon = Daemon(tmp_path / "state", env=daemon_env(hosts, free_port())).start()
        try:
            answer = daemon.admin.post("/admin/nodes/setup", json=body(host.address))
            assert answer.status_code == 202, answer.text
            blobs = store(hosts, 3) / "models" / "blobs"
            wait_until(lambda: blobs.is_dir() and any(blobs.iterdir()), 60, "the blob pushed")
            assert task_of(daemon, host.address)["current_step"] == "verifying"
            engine_pid = host.engine_pid("ollama")
            assert engine_pid is not None
            daemon.stop(signal.SIGKILL)
            host.release("ollama-create")
            daemon.start()
            task = task_of(daemon, host.address)
            assert (task["state"], task["failed_step"]) == ("failed", "verifying")
            # The restart's takeover ends what the killed gateway started: the daemon, and the store with it.
            wait_until(lambda: not alive(engine_pid) and not store(hosts, 3).exists(), 60, "the daemon stopped")
            # The host is free for the next setup, which succeeds.
            again = daemon.admin.post("/admin/nodes/setup", json=body(host.address))
            assert again.status_code == 202, again.text
            assert wait_operation(daemon, again.json()["id"])["state"] == "succeeded"
            daemon.wait_status(host.address, "healthy", timeout_s=30)
            teardown = daemon.admin.delete(f"/admin/nodes/{host.address}")
            assert wait_operation(daemon, teardown.json()["id"])["state"] == "succeeded"
        finally:
            daemon.close()
    finally:
        host.release("ollama-create")


def test_two_setups_of_one_host_at_once_one_runs_the_other_is_refused(hosts: SshHosts, tmp_path: Path) -> None:
    host = hosts[0]
    host.hold("ollama-create")
    try:
        with Daemon(tmp_path / "state", env=daemon_env(hosts, free_port())) as daemon:
            first = daemon.admin.post("/admin/nodes/setup", json=body(host.address))
            assert first.status_code == 202, first.text
            second = daemon.admin.post("/admin/nodes/setup", json=body(host.address))
            assert second.status_code == 409, second.text
            host.release("ollama-create")
            assert wait_operation(daemon, first.json()["id"])["state"] == "succeeded"
            assert [p for p in (host.engine_pid("ollama"),) if p is not None and alive(p)]
            teardown = daemon.admin.delete(f"/admin/nodes/{host.address}")
            assert wait_operation(daemon, teardown.json()["id"])["state"] == "succeeded"
    finally:
        host.release("ollama-create")


def test_a_deployment_with_engine_ollama_places_serves_scales_explains_and_is_deleted(
    hosts: SshHosts, tmp_path: Path
) -> None:
    usable, too_old = [hosts[0].address, hosts[3].address], hosts[2].address
    pool = [{"name": address, "memory_mib": 4096} for address in (*usable, too_old)]
    env = daemon_env(
        hosts,
        free_port(),
        QIIP_HOSTS=json.dumps(pool),
        QIIP_DEPLOYMENTS__RECONCILE_INTERVAL_S="0.3",
        QIIP_DEPLOYMENTS__FAILURE_BACKOFF_S="600",
        QIIP_HEALTH__INTERVAL_S="0.3",
    )
    artifact = next(g.artifact_id for g in scan_catalog(hosts.models).gguf if g.repo_id == TINY_REPO)  # type: ignore[attr-defined]
    spec: dict[str, Any] = {
        "name": "tiny-o",
        "engine": "ollama",
        "replicas": 2,
        "source": {"artifact": artifact},
        "runtime": {"sizing": TINY_SIZING},
        "placement": {"hosts": usable},
    }
    with Daemon(tmp_path / "state", env=env) as daemon:
        answer = daemon.admin.put("/admin/deployments/tiny-o", json=spec)
        assert answer.status_code == 201, answer.text
        wait_until(lambda: settled(daemon, "tiny-o", 2), 240, "two ready Ollama replicas")
        assert ready_hosts(daemon, "tiny-o") == set(usable)
        with ClientLoop(daemon.url, "tiny-o") as loop:
            wait_until(lambda: loop.statuses.get(200, 0) >= 10, 60, "ten answers")
        assert set(loop.statuses) == {200}, loop.statuses

        # Scaled to one: a replica is drained and torn down, its daemon stopped and its store freed.
        generation = deployment(daemon, "tiny-o")["generation"]
        scaled = daemon.admin.put(
            "/admin/deployments/tiny-o", params={"generation": generation}, json=spec | {"replicas": 1}
        )
        assert scaled.status_code == 200, scaled.text
        wait_until(lambda: settled(daemon, "tiny-o", 1), 120, "one replica")
        (kept,) = ready_hosts(daemon, "tiny-o")
        gone = next(i for i, h in enumerate(hosts.hosts) if h.address in usable and h.address != kept)
        wait_until(lambda: not store(hosts, gone).exists(), 60, "the scaled-down replica's store freed")

        # A host whose Ollama is not the pinned release fails its setup once, and explain says why after.
        other = {"name": "tiny-p", "engine": "ollama", "replicas": 1, "source": {"artifact": artifact}}
        other |= {"runtime": {"sizing": TINY_SIZING}, "placement": {"hosts": [too_old]}}
        assert daemon.admin.put("/admin/deployments/tiny-p", json=other).status_code == 201

        def explained() -> str:
            found = daemon.admin.get("/admin/deployments/tiny-p/explain").json()
            return " ".join(" ".join(h["reasons"]) for h in found.get("hosts", []) if h["host"] == too_old)

        wait_until(lambda: "ollama_install" in explained(), 120, "the failed setup explained")
        assert "is version 0.5.1, not the pinned 0.9.6" in explained()

        for name in ("tiny-o", "tiny-p"):
            assert daemon.admin.delete(f"/admin/deployments/{name}").status_code == 202
            wait_until(lambda: daemon.admin.get(f"/admin/deployments/{name}").status_code == 404, 120, f"{name} gone")  # noqa: B023
        assert not any(store(hosts, i).exists() for i in (0, 3))
        assert "Traceback" not in daemon.log()


def test_a_port_another_ollama_holds_fails_the_setup_before_anything_is_pushed(hosts: SshHosts, tmp_path: Path) -> None:
    host, port = hosts[3], free_port()
    # The host's own Ollama (the same release) on the engine port: QIIP's daemon could not bind, and the setup must
    # not go on against the other one.
    with OllamaStandIn([], version=VERSION, host=host.address, port=port) as foreign:
        with Daemon(tmp_path / "state", env=daemon_env(hosts, port)) as daemon:
            answer = daemon.admin.post("/admin/nodes/setup", json=body(host.address))
            assert wait_operation(daemon, answer.json()["task_id"])["state"] == "failed"
            task = task_of(daemon, host.address)
            assert task["failed_step"] == "starting_engine", task
            assert f"port {port} on {host.address} is taken by another process" in task["error"]
        assert foreign.blobs == {} and foreign.models == {}
        assert host.engine_pid("ollama") is None
