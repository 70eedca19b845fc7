"""`GET /admin/nodes/{host}/recommendations` through the real daemon: the real llmfit, installed and run on a loopback
SSH host, its answer marked against the daemon's catalog (a real Hugging Face cache); and `qiip node
recommendations` on top of it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from qiip_core.client import ApiError, QiipClient
from qiip_core.engines.llamacpp import make_test_gguf
from qiip_core.recommendations import HostRecommendations
from tests.support.cli import run_qiip
from tests.support.daemon import Daemon
from tests.support.hf_cache import HfCacheBuilder
from tests.support.sshd import SshHosts

pytestmark = pytest.mark.integration

GPU_PROFILE = "apple-m3-max-128gb"
"""A bundled llmfit profile with a GPU, standing in for a GPU host."""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    with SshHosts(tmp_path_factory.mktemp("recommend-ssh"), 1, family="debian", gpu=False, first=50) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("recommend-hf") / "hub"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, hosts: SshHosts, cache: Path) -> Iterator[Daemon]:
    env = {
        "QIIP_PROVISIONING__SSH_PORT": str(hosts.port),
        "QIIP_PROVISIONING__SSH_KEY_FILE": str(hosts.client_key),
        "QIIP_PROVISIONING__KNOWN_HOSTS_FILE": str(hosts.known_hosts),
        "QIIP_PROVISIONING__LLMFIT_TIMEOUT_S": "120",
        "QIIP_MODELS__HF_CACHE_DIR": str(cache),
    }
    with Daemon(tmp_path_factory.mktemp("recommend-daemon"), env=env) as daemon:
        yield daemon


def add_to_catalog(cache: Path, model: str, gguf_repo: str, work: Path) -> None:
    """The model as a full safetensors snapshot, and a GGUF of its source repository (a generated one)."""
    builder = HfCacheBuilder(cache)
    commit = "d" * 40
    builder.add_file(model, commit, "config.json", data=b'{"model_type": "qwen3"}', lfs=False)
    builder.add_file(model, commit, "model.safetensors", data=b"\0" * 16)
    builder.set_ref(model, "main", commit)
    [gguf] = make_test_gguf(work / "tiny.gguf")
    builder.add_file(gguf_repo, commit, "model-Q8_0.gguf", source=gguf)
    builder.set_ref(gguf_repo, "main", commit)


def test_a_gpu_profile_is_ranked_and_marked_against_the_catalog(
    daemon: Daemon, hosts: SshHosts, cache: Path, tmp_path: Path
) -> None:
    host = hosts[0].address
    path = f"/admin/nodes/{host}/recommendations"
    answer = daemon.admin.get(path, params={"profile": GPU_PROFILE, "limit": 10}, timeout=180)
    assert answer.status_code == 200, (answer.text, daemon.log()[-2000:])
    found = HostRecommendations.model_validate(answer.json())
    assert found.host == host and found.profile == GPU_PROFILE and found.system.unified_memory
    assert [r.rank for r in found.recommendations] == list(range(1, 11))
    assert {"vllm", "llama_cpp"} <= {r.runtime for r in found.recommendations}
    assert not any(r.in_catalog for r in found.recommendations)
    body = answer.json()["recommendations"][0]
    assert {"estimated_tokens_per_s", "memory_required_gib", "fit_level", "runtime", "gguf_sources"} <= set(body)

    # Put one recommended model, and one GGUF repository llmfit names for it, into the daemon's cache.
    pick = next(r for r in found.recommendations if r.gguf_sources)
    add_to_catalog(cache, pick.repo, pick.gguf_sources[0].repo, tmp_path)
    again = HostRecommendations.model_validate(
        daemon.admin.get(path, params={"profile": GPU_PROFILE, "limit": 10}, timeout=180).json()
    )
    assert [r.repo for r in again.recommendations if r.in_catalog] == [pick.repo]
    marked = next(r for r in again.recommendations if r.repo == pick.repo)
    assert [s.in_catalog for s in marked.gguf_sources] == [i == 0 for i in range(len(marked.gguf_sources))]
    assert marked.gguf_sources[0].quantization == pick.quantization and marked.gguf_sources[0].file is None


def test_this_host_and_the_cli(daemon: Daemon, hosts: SshHosts, tmp_path: Path) -> None:
    host = hosts[0].address
    env = {"QIIP_URL": daemon.url, "QIIP_ADMIN__USERNAME": "admin", "QIIP_ADMIN__PASSWORD": "test-password"}
    table = run_qiip(tmp_path, "node", "recommendations", host, "--profile", GPU_PROFILE, "-n", "3", env=env)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].startswith(f"{host}: llmfit 1.1.17 on profile {GPU_PROFILE}: 128.0 GiB RAM, 1 GPU")
    assert lines[1].split() == ["#", "MODEL", "RUNTIME", "FIT", "TOK/S", "MEM", "GIB", "QUANT", "CATALOG"]
    assert [line.split()[0] for line in lines[2:]] == ["1", "2", "3"]
    own = run_qiip(tmp_path, "node", "recommendations", host, "--json", "-n", "2", env=env, timeout_s=180)
    assert own.returncode == 0, own.stderr
    found = HostRecommendations.model_validate(json.loads(own.stdout))
    assert found.profile is None and found.system.gpu_count == 0 and len(found.recommendations) <= 2


@pytest.mark.parametrize(
    ("host", "params", "status", "code"),
    [
        ("10.1.2.3", {}, 400, "host_not_allowed"),
        ("gpu01.example.com", {}, 400, "host_not_allowed"),
        ("127.0.0.50", {"limit": 0}, 422, "invalid_request"),
        ("127.0.0.50", {"profile": "--ram=1T"}, 422, "invalid_request"),
    ],
)
def test_refusals_before_any_ssh(
    daemon: Daemon, host: str, params: dict[str, str | int], status: int, code: str
) -> None:
    answer = daemon.admin.get(f"/admin/nodes/{host}/recommendations", params=params)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code


def test_llmfit_and_ssh_failures_are_502_with_the_reason(daemon: Daemon, hosts: SshHosts, tmp_path: Path) -> None:
    failed = daemon.admin.get(f"/admin/nodes/{hosts[0].address}/recommendations", params={"profile": "no-such-gpu"})
    assert failed.status_code == 502, failed.text
    error = failed.json()["error"]
    assert error["code"] == "llmfit_failed" and "unknown hardware profile 'no-such-gpu'" in error["message"]
    # An allowed address where no SSH server listens.
    refused = daemon.admin.get("/admin/nodes/127.0.0.59/recommendations")
    assert refused.status_code == 502 and refused.json()["error"]["code"] == "ssh_error"
    assert "refused" in refused.json()["error"]["message"]
    env = {"QIIP_URL": daemon.url, "QIIP_ADMIN__USERNAME": "admin", "QIIP_ADMIN__PASSWORD": "test-password"}
    cli = run_qiip(tmp_path, "node", "recommendations", "10.1.2.3", env=env)
    assert cli.returncode == 1 and len(cli.stderr.strip().splitlines()) == 1 and "10.1.2.3" in cli.stderr


def test_a_silent_llmfit_is_a_504(hosts: SshHosts, tmp_path: Path) -> None:
    # A profile file that is a FIFO nobody writes: llmfit waits on it until the deadline stops it.
    fifo = tmp_path / "profile.json"
    os.mkfifo(fifo)
    env = {
        "QIIP_PROVISIONING__SSH_PORT": str(hosts.port),
        "QIIP_PROVISIONING__SSH_KEY_FILE": str(hosts.client_key),
        "QIIP_PROVISIONING__KNOWN_HOSTS_FILE": str(hosts.known_hosts),
        "QIIP_PROVISIONING__LLMFIT_TIMEOUT_S": "3",
    }
    with Daemon(tmp_path / "state", env=env) as daemon:
        answer = daemon.admin.get(f"/admin/nodes/{hosts[0].address}/recommendations", params={"profile": str(fifo)})
    assert answer.status_code == 504, answer.text
    error = answer.json()["error"]
    assert error["code"] == "remote_timeout" and "provisioning.llmfit_timeout_s" in error["message"]


async def test_the_client_method(daemon: Daemon, hosts: SshHosts) -> None:
    async with QiipClient(daemon.url, username="admin", password="test-password") as client:
        found = await client.recommendations(hosts[0].address, profile=GPU_PROFILE, limit=2)
        assert found.profile == GPU_PROFILE and [r.rank for r in found.recommendations] == [1, 2]
        with pytest.raises(ApiError) as caught:
            await client.recommendations("10.1.2.3")
    assert caught.value.status == 400 and caught.value.code == "host_not_allowed"
