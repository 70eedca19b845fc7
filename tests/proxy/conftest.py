from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.daemon import Daemon, llama_daemon_with
from tests.support.fault_backend import FaultBackend


@pytest.fixture(scope="module")
def llama_daemon(
    tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path, llama_server_binary: Path
) -> Iterator[Daemon]:
    """A daemon serving the tiny model as two local llama.cpp nodes (chat) plus one embeddings node."""
    local = [
        {"id": "chat-a", "gguf": str(tiny_gguf), "model": "tiny-chat", "slots": 2, "threads": 1},
        {"id": "chat-b", "gguf": str(tiny_gguf), "model": "tiny-chat", "slots": 2, "threads": 1},
        {"id": "embed", "gguf": str(tiny_gguf), "model": "tiny-embed", "slots": 1, "embeddings": True, "threads": 1},
    ]
    with llama_daemon_with(tmp_path_factory.mktemp("llama-daemon"), llama_server_binary, local) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def fault_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon for relay and failover tests: nodes are probed once when registered, then rarely, so a
    node the test breaks afterwards is still `healthy` when the request arrives. Least-connections spreads
    the tests' identical requests over the nodes (prefix affinity would keep them on the node that answered
    the first)."""
    env = {
        "QIIP_ROUTING__POLICY": "least_connections",
        "QIIP_HEALTH__INTERVAL_S": "60",
        "QIIP_HEALTH__FAILURE_THRESHOLD": "3",
        "QIIP_UPSTREAM__TTFB_TIMEOUT_S": "1",
        "QIIP_UPSTREAM__GENERATION_TIMEOUT_S": "1",
        "QIIP_UPSTREAM__IDLE_TIMEOUT_S": "1",
        "QIIP_SERVER__MAX_BODY_BYTES": str(1 << 20),
    }
    with Daemon(tmp_path_factory.mktemp("fault-daemon"), env=env) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def health_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon that probes every node ten times a second and demotes it after one failed probe."""
    with Daemon(tmp_path_factory.mktemp("health-daemon")) as daemon:
        yield daemon


@pytest.fixture
def backends() -> Iterator[Callable[..., FaultBackend]]:
    """Make fault backends that are closed at the end of the test."""
    made: list[FaultBackend] = []

    def make(model: str = "fault-model") -> FaultBackend:
        backend = FaultBackend(model=model)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


@pytest.fixture
def model(request: pytest.FixtureRequest) -> str:
    """A model name of this test's own, so its nodes never serve another test."""
    return "m-" + re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)
