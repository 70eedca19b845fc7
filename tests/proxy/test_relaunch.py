"""Relaunching managed llama.cpp nodes through the admin API, against real llama-server processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.bad_models import LLAMA_SERVER_REFUSES, write_bad_model
from tests.support.daemon import Daemon, llama_daemon_with, wait_until
from tests.support.openai_client import openai_client

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def victim_model(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Path:
    """A copy of the tiny model for the `victim` node, which a test may damage."""
    victim = tmp_path_factory.mktemp("victim") / "victim.gguf"
    shutil.copyfile(tiny_gguf, victim)
    return victim


@pytest.fixture(scope="module")
def relaunch_daemon(
    tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path, victim_model: Path, llama_server_binary: Path
) -> Iterator[Daemon]:
    """Two local nodes on the tiny model: `small`, and `victim` on a file of its own."""
    victim = victim_model
    local = [
        {"id": "small", "gguf": str(tiny_gguf), "model": "small", "slots": 2, "threads": 1},
        {"id": "victim", "gguf": str(victim), "model": "victim", "slots": 1, "threads": 1},
    ]
    with llama_daemon_with(tmp_path_factory.mktemp("relaunch-daemon"), llama_server_binary, local) as daemon:
        yield daemon


def relaunch(daemon: Daemon, node_id: str, policy: dict[str, Any]) -> dict[str, Any]:
    answer = daemon.admin.post(f"/admin/nodes/{node_id}/llamacpp/relaunch", json=policy)
    assert answer.status_code == 202, answer.text
    result: dict[str, Any] = {}

    def done() -> bool:
        result.update(daemon.admin.get(f"/admin/operations/{answer.json()['id']}").json())
        return bool(result["state"] != "running")

    wait_until(done, 120, "the relaunch")
    return result


def runtime(daemon: Daemon, node_id: str) -> dict[str, Any]:
    record = daemon.admin.get(f"/admin/nodes/{node_id}").json()["llamacpp_runtime"]
    assert record is not None
    return dict(record)


def test_local_nodes_carry_a_verified_runtime_record(relaunch_daemon: Daemon) -> None:
    record = runtime(relaunch_daemon, "small")
    assert record["requested"]["sizing"] == "custom"
    effective = record["effective"]
    assert effective["slots"] == 2 and effective["context_per_slot"] == 2048
    assert effective["device_mode"] == "cpu"
    assert record["observed_at"].endswith(("Z", "+00:00"))
    node = relaunch_daemon.admin.get("/admin/nodes/small").json()
    assert node["managed"] is True and node["engine"] == "llama_cpp"


def test_probes_read_the_slots_of_llama_server(relaunch_daemon: Daemon) -> None:
    def slots() -> object:
        return relaunch_daemon.admin.get("/admin/nodes/small").json()["slots"]

    wait_until(lambda: slots() is not None, 30, "a probe of GET /slots")
    assert slots() == {"busy": 0, "total": 2}


def test_relaunch_custom_then_auto(relaunch_daemon: Daemon) -> None:
    done = relaunch(
        relaunch_daemon,
        "small",
        {"sizing": "custom", "fit_target_mib": 512, "context_per_slot": 1024, "slots": 4, "cache_type": "f16"},
    )
    assert done["state"] == "succeeded", done
    effective = runtime(relaunch_daemon, "small")["effective"]
    assert effective["slots"] == 4 and effective["context_per_slot"] == 1024
    endpoint = relaunch_daemon.admin.get("/admin/nodes/small").json()["endpoint"]
    assert httpx.get(endpoint + "/props", timeout=10).json()["total_slots"] == 4
    relaunch_daemon.wait_status("small", "healthy", timeout_s=30)
    client = openai_client(relaunch_daemon.url + "/v1")
    assert client.completions.create(model="small", prompt="hi", max_tokens=2).choices

    done = relaunch(relaunch_daemon, "small", {"sizing": "auto", "fit_target_mib": 512})
    assert done["state"] == "succeeded", done
    record = runtime(relaunch_daemon, "small")
    assert record["requested"] == {"sizing": "auto", "fit_target_mib": 512}
    assert record["effective"]["context_per_slot"] == 2048
    relaunch_daemon.wait_status("small", "healthy", timeout_s=30)


def test_when_the_rollback_fails_too_only_removal_is_left(
    relaunch_daemon: Daemon, victim_model: Path, tmp_path: Path
) -> None:
    # A file every check accepts and llama-server refuses, in place of the node's own: the rollback meets it too.
    refused, _ = write_bad_model(tmp_path / "refused.gguf", LLAMA_SERVER_REFUSES)
    os.replace(refused, victim_model)
    done = relaunch(
        relaunch_daemon,
        "victim",
        {"sizing": "custom", "fit_target_mib": 512, "context_per_slot": 512, "slots": 1, "cache_type": "f16"},
    )
    assert done["state"] == "failed" and "so did the rollback" in str(done["error"])
    relaunch_daemon.wait_status("victim", "relaunch_failed", timeout_s=30)
    assert relaunch_daemon.admin.get("/admin/nodes/victim").json()["llamacpp_runtime"] is None
    refusal = relaunch_daemon.admin.post("/admin/nodes/victim/llamacpp/relaunch", json={"sizing": "auto"})
    assert refusal.status_code == 409
    assert relaunch_daemon.admin.post("/admin/nodes/victim/drain", json={}).status_code == 409
    removal = relaunch_daemon.admin.delete("/admin/nodes/victim")
    assert removal.status_code == 202
    relaunch_daemon.wait_gone("victim", timeout_s=30)
    wait_until(
        lambda: relaunch_daemon.client.get("/health").json()["local_nodes"]["victim"] == "removed",
        what="/health to say the local node was removed",
    )


def test_relaunch_refusals(relaunch_daemon: Daemon) -> None:
    admin = relaunch_daemon.admin
    unaligned = admin.post(
        "/admin/nodes/small/llamacpp/relaunch",
        json={"sizing": "custom", "fit_target_mib": 512, "context_per_slot": 1000, "slots": 2, "cache_type": "f16"},
    )
    assert unaligned.status_code == 422
    violations = unaligned.json()["error"]["violations"]
    assert any(v["field"] == "context_per_slot" and "256" in v["message"] for v in violations)
    too_long = admin.post(
        "/admin/nodes/small/llamacpp/relaunch",
        json={"sizing": "custom", "fit_target_mib": 512, "context_per_slot": 8192, "slots": 1, "cache_type": "f16"},
    )
    assert too_long.status_code == 422
    assert "training context" in json.dumps(too_long.json()["error"]["violations"])
    unknown = admin.post("/admin/nodes/small/llamacpp/relaunch", json={"sizing": "auto", "bogus": 1})
    assert unknown.status_code == 422
    assert admin.post("/admin/nodes/ghost/llamacpp/relaunch", json={"sizing": "auto"}).status_code == 404


def _llama_server_pid(port: int) -> int:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"llama-server") and str(port).encode() in argv:
            return int(proc.name)
    raise AssertionError(f"no llama-server listens on port {port}")


def test_a_crashed_local_node_comes_back_with_a_relaunch(relaunch_daemon: Daemon) -> None:
    endpoint = relaunch_daemon.admin.get("/admin/nodes/small").json()["endpoint"]
    os.kill(_llama_server_pid(urlsplit(endpoint).port or 0), signal.SIGKILL)
    relaunch_daemon.wait_status("small", "unhealthy", timeout_s=30)
    done = relaunch(relaunch_daemon, "small", {"sizing": "auto", "fit_target_mib": 512})
    assert done["state"] == "succeeded", done
    relaunch_daemon.wait_status("small", "healthy", timeout_s=30)
    client = openai_client(relaunch_daemon.url + "/v1")
    assert client.completions.create(model="small", prompt="hi", max_tokens=2).choices
