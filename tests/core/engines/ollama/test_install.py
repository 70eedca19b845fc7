"""A verified GGUF made into a model of an Ollama daemon by its digest (blob push, create, load, checks), against the
Ollama stand-in; and the environment and names of the Ollama daemon QIIP runs on a host."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from qiip_core.engines.ollama import (
    OllamaInstallFailed,
    check_ollama_name,
    install_model,
    serve_environment,
)
from qiip_core.health import health_session
from tests.support.ollama import OllamaStandIn

pytestmark = pytest.mark.integration


@pytest.fixture
def ollama() -> Iterator[OllamaStandIn]:
    with OllamaStandIn([]) as server:
        yield server


@pytest.fixture
def gguf(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "qwen3-0.6b-q4_k_m.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4096)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


async def test_the_gguf_is_pushed_by_its_digest_made_a_model_loaded_and_checked(
    ollama: OllamaStandIn, gguf: tuple[Path, str]
) -> None:
    path, sha256 = gguf
    async with health_session(policy=None, timeout_s=30) as session:
        installed = await install_model(
            ollama.url, name="qiip/qwen3-0.6b:q4_k_m", gguf=path, sha256=sha256, session=session
        )
        assert installed.pushed and installed.size_bytes == path.stat().st_size
        assert (
            installed.resident.name == "qiip/qwen3-0.6b:q4_k_m"
            and installed.resident.size_bytes >= installed.size_bytes
        )
        assert ollama.blobs == {f"sha256:{sha256}": path.stat().st_size}
        assert ollama.models["qiip/qwen3-0.6b:q4_k_m"].blob == f"sha256:{sha256}"
        # Again (a retried setup): the blob is there, so it is not sent twice.
        again = await install_model(
            ollama.url, name="qiip/qwen3-0.6b:q4_k_m", gguf=path, sha256=sha256, session=session
        )
    assert not again.pushed
    assert [request for request in ollama.requests if request[0] == "POST" and "blobs" in request[1]] == [
        ("POST", f"/api/blobs/sha256:{sha256}")
    ]


async def test_bytes_that_do_not_match_the_digest_are_refused_by_the_server_and_nothing_is_made(
    ollama: OllamaStandIn, gguf: tuple[Path, str]
) -> None:
    path, _ = gguf
    wrong = "0" * 64
    async with health_session(policy=None, timeout_s=30) as session:
        with pytest.raises(OllamaInstallFailed) as refused:
            await install_model(ollama.url, name="qwen3:q4", gguf=path, sha256=wrong, session=session)
    assert refused.value.step == "pushing_blob"
    assert f'answered 400: digest mismatch, expected "sha256:{wrong}"' in str(refused.value)
    assert ollama.blobs == {} and ollama.models == {}


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("qwen;rm -rf ~:q4", "the model of 'qwen;rm -rf ~:q4' must be 1 to 80 of letters, digits, '_', '-' and '.'"),
        ("$(id):latest", "the model of '$(id):latest' must be"),
        ("qwen3:q4 x", "the tag of 'qwen3:q4 x' must be"),
        ("qwen3", "'qwen3' has no tag"),
        ("a/b/c:d", "more than a namespace and a model"),
        ("my.org/qwen3:q4", "the namespace of 'my.org/qwen3:q4' must be 1 to 80 of letters, digits, '_' and '-',"),
        ("-qwen3:q4", "the model of '-qwen3:q4' must be"),
        ("q" * 81 + ":q4", "must be 1 to 80"),
        ("qwen:q4\n", "the tag of 'qwen:q4\\n' must be"),
        ("ns\n/m:t", "the namespace of"),
        ("library/qwen:q4", "Ollama's default namespace 'library': name it qwen:q4"),
        ("Library/qwen:q4", "Ollama's default namespace 'library'"),
    ],
)
async def test_a_bad_name_is_refused_before_any_request(
    ollama: OllamaStandIn, gguf: tuple[Path, str], name: str, why: str
) -> None:
    path, sha256 = gguf
    async with health_session(policy=None, timeout_s=30) as session:
        with pytest.raises(OllamaInstallFailed) as refused:
            await install_model(ollama.url, name=name, gguf=path, sha256=sha256, session=session)
    assert refused.value.step == "checking" and why in str(refused.value)
    assert ollama.requests == []


@pytest.mark.parametrize("sha256", ["A" * 64, "0" * 63, "sha256:" + "0" * 64, "", "0" * 64 + "\n"])
async def test_a_bad_digest_or_a_missing_file_is_refused_before_any_request(
    ollama: OllamaStandIn, gguf: tuple[Path, str], sha256: str, tmp_path: Path
) -> None:
    path, good = gguf
    async with health_session(policy=None, timeout_s=30) as session:
        with pytest.raises(OllamaInstallFailed, match="sha256 must be 64 lowercase hex digits"):
            await install_model(ollama.url, name="qwen3:q4", gguf=path, sha256=sha256, session=session)
        with pytest.raises(OllamaInstallFailed, match="cannot be read"):
            await install_model(ollama.url, name="qwen3:q4", gguf=tmp_path / "gone.gguf", sha256=good, session=session)
    assert ollama.requests == []


def test_the_daemon_is_qiips_own_on_the_engine_port_with_its_store_no_cloud_and_the_planned_slots() -> None:
    env = serve_environment(bind="10.0.0.7", port=8000, root="/opt/qiip/", slots=4, context_per_slot=8192)
    assert env == {
        "OLLAMA_HOST": "10.0.0.7:8000",
        "OLLAMA_MODELS": "/opt/qiip/var/lib/qiip-node/ollama/models",
        "OLLAMA_NUM_PARALLEL": "4",
        "OLLAMA_CONTEXT_LENGTH": "8192",
        "OLLAMA_KEEP_ALIVE": "-1",
        "OLLAMA_MAX_LOADED_MODELS": "1",
        "OLLAMA_NO_CLOUD": "1",
        "OLLAMA_REMOTES": "127.0.0.1",
        "OLLAMA_NOPRUNE": "1",
    }
    # Go's net.SplitHostPort reads an IPv6 address only in brackets (else Ollama falls back to its port 11434).
    v6 = serve_environment(bind="::", port=8000, root="", slots=1, context_per_slot=512)
    assert (v6["OLLAMA_HOST"], v6["OLLAMA_MODELS"]) == ("[::]:8000", "/var/lib/qiip-node/ollama/models")
    for bad in ({"slots": 0}, {"context_per_slot": 0}, {"port": 0}, {"port": 70000}):
        args = {"bind": "0.0.0.0", "port": 8000, "root": "/r", "slots": 1, "context_per_slot": 1} | bad
        with pytest.raises(ValueError):
            serve_environment(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["llama3.2:3b", "qiip/qwen3-0.6b:q4_k_m", "_x:_y", "a" * 80 + ":" + "b" * 80])
def test_names_ollama_takes_are_taken(name: str) -> None:
    assert check_ollama_name(name) == name
