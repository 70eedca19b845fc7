"""`qiip up --artifact ID`: a GGUF downloaded from a (loopback) hub, served by a real llama-server through the
gateway, the node record carrying its artifact id."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from qiip_core.catalog import Download, download_files, scan_catalog
from qiip_core.client import read_console_file
from qiip_core.config import ModelSettings
from tests.cli.test_up import _run_up, _up, _up_env
from tests.support.daemon import free_port, wait_until
from tests.support.fake_hub import FakeHub
from tests.support.model_cache import ModelCache
from tests.support.openai_client import openai_client

pytestmark = pytest.mark.integration


def test_a_downloaded_generation_is_served_by_its_artifact_id(
    tmp_path: Path, model_cache: ModelCache, llama_server_binary: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    hub = FakeHub()
    hub.add("qiip-test/served-GGUF", "f" * 40, {"tiny-F16.gguf": model_cache.tiny})
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with hub.running():
        download_files(
            Download(id="dl_1", repo_id="qiip-test/served-GGUF", revision="main", files=()),
            settings=ModelSettings(hub_endpoint=hub.endpoint),
            cache_dir=cache,
        )
    (generation,) = scan_catalog(cache).gguf
    env = _up_env(tmp_path, llama_server_binary) | {"QIIP_MODELS__HF_CACHE_DIR": str(cache)}
    port = free_port()
    # The 16 characters `qiip model list` shows are enough; the node record carries the whole id.
    with _up(port, "--artifact", f"tiny={generation.artifact_id[:16]}", env=env, cwd=tmp_path):
        client = openai_client(f"http://127.0.0.1:{port}/v1")
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 3
        client.close()
        console = read_console_file(tmp_path / "state" / "console.toml")
        auth = (str(console["username"]), str(console["password"]))
        nodes = httpx.get(f"http://127.0.0.1:{port}/admin/nodes", auth=auth, timeout=10).json()["nodes"]
        assert [(n["id"], n["artifact_id"]) for n in nodes] == [("local", generation.artifact_id)]
        catalog = httpx.get(f"http://127.0.0.1:{port}/admin/models/catalog", auth=auth, timeout=30).json()
        assert catalog["gguf"][0]["nodes"] == ["local"]
        # A relaunch with another sizing keeps the record's artifact.
        base = f"http://127.0.0.1:{port}/admin"
        custom = {"sizing": "custom", "fit_target_mib": 512, "context_per_slot": 1024, "slots": 1, "cache_type": "f16"}
        operation = httpx.post(f"{base}/nodes/local/llamacpp/relaunch", json=custom, auth=auth, timeout=30).json()
        wait_until(
            lambda: httpx.get(f"{base}/operations/{operation['id']}", auth=auth).json()["state"] != "running",
            timeout_s=120,
            what="the relaunch",
        )
        assert httpx.get(f"{base}/operations/{operation['id']}", auth=auth).json()["state"] == "succeeded"
        relaunched = httpx.get(f"{base}/nodes/local", auth=auth).json()
        assert relaunched["artifact_id"] == generation.artifact_id
        assert relaunched["llamacpp_runtime"]["effective"]["slots"] == 1


def test_an_unknown_artifact_is_refused_in_one_line(
    tmp_path: Path, model_cache: ModelCache, llama_server_binary: Path
) -> None:
    env = _up_env(tmp_path, llama_server_binary) | {"QIIP_MODELS__HF_CACHE_DIR": str(model_cache.root)}
    refused = _run_up(env, "--artifact", "f" * 64, timeout_s=60)
    assert refused.returncode == 1
    assert f"No GGUF generation with artifact_id {'f' * 64} is in the Hugging Face cache" in refused.stderr
