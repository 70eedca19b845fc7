"""The daemon's own llama.cpp nodes (`LocalNodes`), on real llama-servers: one that fails fails alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

from qiip_core.config import load_settings
from qiip_core.discovery import EmbeddedRegistry
from qiip_core.nodes import Node
from qiip_proxy._local_nodes import LocalNodes
from tests.support.daemon import WAIT_S


class _BrokenForOneNode(EmbeddedRegistry):
    """The embedded registry, failing the registration of node `first` with an error no launch step expects."""

    async def register(self, node: Node, *, ephemeral: bool = False) -> Node:
        if node.id == "first":
            raise RuntimeError("the registry broke")
        return await super().register(node, ephemeral=ephemeral)


async def test_a_node_that_fails_after_its_server_started_is_stopped_and_the_next_still_launches(
    tmp_path: Path, tiny_gguf: Path, llama_server_binary: Path
) -> None:
    settings = load_settings(
        state_dir=tmp_path,
        engines={"llamacpp": {"server_binary": str(llama_server_binary)}},
        local_nodes=[
            {"id": "first", "model": "a", "gguf": str(tiny_gguf), "slots": 1},
            {"id": "second", "model": "b", "gguf": str(tiny_gguf), "slots": 1},
        ],
    )
    registry = _BrokenForOneNode(settings)
    local = LocalNodes(settings, registry)
    try:
        await asyncio.wait_for(local._launch_all(), timeout=2 * WAIT_S)
        assert local.states() == {"first": "failed", "second": "serving"}
        assert local.errors["first"] == "RuntimeError: the registry broke"
        # Its llama-server is not left running unregistered; the other one serves.
        first, second = local.servers["first"].process, local.servers["second"].process
        assert first is not None and first.returncode is not None
        assert second is not None and second.returncode is None
        assert [n.node.id for n in registry.nodes()] == ["second"]
    finally:
        await local.aclose()
