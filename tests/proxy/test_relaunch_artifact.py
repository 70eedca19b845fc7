"""Relaunching a local llama.cpp node onto another GGUF generation of the Hugging Face cache, by artifact id,
against a real daemon and real llama-server processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qiip_core.catalog import GgufGeneration, scan_catalog
from tests.support.daemon import Daemon, llama_daemon_with, wait_until
from tests.support.model_cache import COMMIT_A, TINY_REPO, ModelCache
from tests.support.openai_client import openai_client

pytestmark = pytest.mark.integration


def _generation(cache: ModelCache, entrypoint: str) -> GgufGeneration:
    (found,) = [
        g
        for g in scan_catalog(cache.root).gguf
        if g.repo_id == TINY_REPO and g.revision == COMMIT_A and g.entrypoint == entrypoint
    ]
    return found


@pytest.fixture(scope="module")
def generations(model_cache: ModelCache) -> tuple[GgufGeneration, GgufGeneration]:
    """The standalone tiny GGUF and the complete split family, both at COMMIT_A."""
    return _generation(model_cache, "tiny-F16.gguf"), _generation(model_cache, f"split/{model_cache.split[0].name}")


@pytest.fixture(scope="module")
def artifact_daemon(
    tmp_path_factory: pytest.TempPathFactory,
    model_cache: ModelCache,
    generations: tuple[GgufGeneration, GgufGeneration],
    llama_server_binary: Path,
) -> Iterator[Daemon]:
    """One local node, `moving`, launched on the standalone generation by its artifact id."""
    local = [{"id": "moving", "artifact_id": generations[0].artifact_id, "model": "moving", "slots": 1, "threads": 1}]
    env = {"QIIP_MODELS__HF_CACHE_DIR": str(model_cache.root)}
    with llama_daemon_with(tmp_path_factory.mktemp("artifact-daemon"), llama_server_binary, local, env=env) as daemon:
        yield daemon


def _relaunch(daemon: Daemon, body: dict[str, Any]) -> dict[str, Any]:
    answer = daemon.admin.post("/admin/nodes/moving/llamacpp/relaunch", json=body)
    assert answer.status_code == 202, answer.text
    result: dict[str, Any] = {}

    def done() -> bool:
        result.update(daemon.admin.get(f"/admin/operations/{answer.json()['id']}").json())
        return bool(result["state"] != "running")

    wait_until(done, 120, "the relaunch")
    return result


def _serves(daemon: Daemon) -> None:
    daemon.wait_status("moving", "healthy", timeout_s=60)
    client = openai_client(daemon.url + "/v1")
    assert client.completions.create(model="moving", prompt="hi", max_tokens=2).choices
    client.close()


def test_bad_artifacts_are_refused_before_the_node_is_touched(
    artifact_daemon: Daemon, generations: tuple[GgufGeneration, GgufGeneration]
) -> None:
    admin = artifact_daemon.admin
    before = admin.get("/admin/nodes/moving").json()
    malformed = admin.post("/admin/nodes/moving/llamacpp/relaunch", json={"artifact_id": "tiny"})
    assert malformed.status_code == 422
    assert malformed.json()["error"]["code"] == "invalid_artifact_id"
    assert "'tiny' is not an artifact id" in malformed.json()["error"]["message"]
    unknown = admin.post("/admin/nodes/moving/llamacpp/relaunch", json={"artifact_id": "e" * 64})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "artifact_not_found"
    assert f"No GGUF generation with artifact_id {'e' * 64}" in unknown.json()["error"]["message"]
    bad_sizing = admin.post(
        "/admin/nodes/moving/llamacpp/relaunch",
        json={"artifact_id": generations[1].artifact_id, "sizing": "custom", "slots": 0},
    )
    assert bad_sizing.status_code == 422
    after = admin.get("/admin/nodes/moving").json()
    assert after["status"] == "healthy"
    assert after["artifact_id"] == generations[0].artifact_id
    assert after["llamacpp_runtime"] == before["llamacpp_runtime"]
    assert admin.get("/admin/operations").json()["operations"] == []
    _serves(artifact_daemon)


def test_a_relaunch_moves_the_node_to_another_generation_and_back(
    artifact_daemon: Daemon, generations: tuple[GgufGeneration, GgufGeneration]
) -> None:
    standalone, split = generations
    admin = artifact_daemon.admin
    before = admin.get("/admin/nodes/moving").json()
    done = _relaunch(artifact_daemon, {"artifact_id": split.artifact_id})
    assert done["state"] == "succeeded", done
    assert done["result"]["artifact_id"] == split.artifact_id
    node = admin.get("/admin/nodes/moving").json()
    assert node["artifact_id"] == split.artifact_id
    assert node["endpoint"] == before["endpoint"]
    # Without a sizing the node keeps its own.
    assert node["llamacpp_runtime"]["requested"] == before["llamacpp_runtime"]["requested"]
    assert any(split.artifact_id in entry["message"] for entry in done["log"])
    props = httpx.get(node["endpoint"] + "/props", timeout=10).json()
    assert Path(props["model_path"]).name == Path(split.entrypoint).name
    catalog = admin.get("/admin/models/catalog").json()
    serving = {g["artifact_id"]: g["nodes"] for g in catalog["gguf"]}
    assert serving[split.artifact_id] == ["moving"] and serving[standalone.artifact_id] == []
    _serves(artifact_daemon)

    custom = {"sizing": "custom", "fit_target_mib": 512, "context_per_slot": 512, "slots": 2, "cache_type": "f16"}
    done = _relaunch(artifact_daemon, {"artifact_id": standalone.artifact_id, **custom})
    assert done["state"] == "succeeded", done
    node = admin.get("/admin/nodes/moving").json()
    assert node["artifact_id"] == standalone.artifact_id
    assert node["llamacpp_runtime"]["effective"]["slots"] == 2
    _serves(artifact_daemon)
