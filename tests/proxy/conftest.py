from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.daemon import Daemon


@pytest.fixture(scope="module")
def llama_daemon(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path, llama_server_binary: Path) -> Iterator[Daemon]:
    """A daemon serving the tiny model as two local llama.cpp nodes (chat) plus one embeddings node."""
    local = [
        {"id": "chat-a", "gguf": str(tiny_gguf), "model": "tiny-chat", "slots": 2},
        {"id": "chat-b", "gguf": str(tiny_gguf), "model": "tiny-chat", "slots": 2},
        {"id": "embed", "gguf": str(tiny_gguf), "model": "tiny-embed", "slots": 1, "embeddings": True},
    ]
    env = {"QIIP_LOCAL_NODES": json.dumps(local), "QIIP_ENGINES__LLAMACPP__SERVER_BINARY": str(llama_server_binary)}
    with Daemon(tmp_path_factory.mktemp("llama-daemon"), env=env) as daemon:
        for node_id in ("chat-a", "chat-b", "embed"):
            daemon.wait_status(node_id, "healthy", timeout_s=120)
        yield daemon
