"""The daemon's own llama.cpp nodes (`LocalNodes`), on real llama-servers: one that fails fails alone."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from qiip_core.config import load_settings
from qiip_core.discovery import EmbeddedRegistry
from qiip_core.nodes import Node
from qiip_proxy._local_nodes import LocalNodes
from tests.support.daemon import WAIT_S
from tests.support.llama_server import held_llama_server


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


async def test_a_port_taken_between_its_choice_and_the_servers_start_is_chosen_again(
    tmp_path: Path, tiny_gguf: Path, llama_server_binary: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # llama-server held at its start until the gate opens; meanwhile the test takes the port chosen for it, as any
    # process's outgoing connection may take a port of the ephemeral range.
    held, gate = held_llama_server(tmp_path, llama_server_binary)
    settings = load_settings(
        state_dir=tmp_path / "state",
        engines={"llamacpp": {"server_binary": str(held)}},
        local_nodes=[{"id": "only", "model": "a", "gguf": str(tiny_gguf), "slots": 1}],
    )
    local = LocalNodes(settings, EmbeddedRegistry(settings))
    launching = asyncio.create_task(local._launch_all())
    try:
        while (server := local.servers.get("only")) is None or server.process is None:  # noqa: ASYNC110 - its start
            await asyncio.sleep(0.02)
        taken = server.port
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", taken))
            holder.listen()
            gate.touch()
            await asyncio.wait_for(launching, timeout=2 * WAIT_S)
            assert local.states() == {"only": "serving"}, local.errors
            assert server.port != taken
            assert f"could not bind port {taken}" in caplog.text
    finally:
        launching.cancel()
        await local.aclose()
