from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from qiip_core import ConfigError, EndpointNotAllowed, NodeConflict, NodeNotFound, RegistryUnavailable
from qiip_core.config import Settings, load_settings
from qiip_core.discovery import (
    EmbeddedRegistry,
    RegistryEvent,
    RegistryEventKind,
    RegistryHealth,
    StateFile,
    add_to_state_file,
    list_registrations,
    remove_from_state_file,
)
from qiip_core.nodes import Node


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return load_settings(
        state_dir=tmp_path / "state",
        registry={"poll_interval_s": 0.02},
        nodes=[{"id": "cfg", "endpoint": "http://127.0.0.1:9001", "model": "m"}],
    )


def node(node_id: str, port: int = 9002, model: str = "m") -> Node:
    return Node(id=node_id, endpoint=f"127.0.0.1:{port}", model=model)


def test_state_file_round_trip_and_atomic_layout(settings: Settings) -> None:
    stored = add_to_state_file(settings, node("a"))
    assert stored.endpoint == "http://127.0.0.1:9002"
    doc = json.loads((settings.state_dir / "nodes.json").read_text())
    assert doc["version"] == 1 and doc["nodes"][0]["id"] == "a"
    assert oct((settings.state_dir / "nodes.json").stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in settings.state_dir.iterdir() if p.name.endswith(".tmp")] == []
    assert [(r.node.id, r.source) for r in list_registrations(settings)] == [("a", "state"), ("cfg", "config")]
    assert remove_from_state_file(settings, "a").id == "a"
    assert StateFile(settings.state_dir).read() == {}


def test_add_refusals(settings: Settings) -> None:
    add_to_state_file(settings, node("a"))
    with pytest.raises(NodeConflict):
        add_to_state_file(settings, node("a"))
    add_to_state_file(settings, node("a", 9003), replace=True)
    with pytest.raises(NodeConflict):
        add_to_state_file(settings, node("cfg"))
    with pytest.raises(EndpointNotAllowed):
        add_to_state_file(settings, Node(id="x", endpoint="http://10.1.1.1:8000", model="m"))
    with pytest.raises(NodeNotFound):
        remove_from_state_file(settings, "nope")
    with pytest.raises(NodeConflict):
        remove_from_state_file(settings, "cfg")


def test_a_refused_change_leaves_the_file_untouched(settings: Settings) -> None:
    add_to_state_file(settings, node("a"))
    before = (settings.state_dir / "nodes.json").read_bytes()
    with pytest.raises(NodeConflict):
        add_to_state_file(settings, node("a"))
    assert (settings.state_dir / "nodes.json").read_bytes() == before


def test_corrupt_state_file(settings: Settings) -> None:
    settings.state_dir.mkdir(parents=True)
    (settings.state_dir / "nodes.json").write_text("{not json")
    with pytest.raises(RegistryUnavailable) as info:
        StateFile(settings.state_dir).read()
    assert "move it aside" in info.value.message


def test_invalid_entries_are_skipped(settings: Settings) -> None:
    settings.state_dir.mkdir(parents=True)
    good = node("a").model_copy(update={"endpoint": "http://127.0.0.1:9002"}).model_dump(mode="json")
    (settings.state_dir / "nodes.json").write_text(json.dumps({"version": 1, "nodes": [good, {"id": 5}]}))
    assert list(StateFile(settings.state_dir).read()) == ["a"]


def test_config_node_outside_allowlist_stops_start_up(tmp_path: Path) -> None:
    settings = load_settings(state_dir=tmp_path, nodes=[{"id": "x", "endpoint": "http://10.0.0.1:8000", "model": "m"}])
    with pytest.raises(ConfigError) as info:
        EmbeddedRegistry(settings)
    assert "nodes.0.endpoint" in info.value.message


async def test_registry_follows_the_state_file(settings: Settings) -> None:
    events: list[RegistryEvent] = []
    registry = EmbeddedRegistry(settings)
    await registry.start(events.append)
    try:
        assert [(e.kind, e.node_id, e.source) for e in events] == [(RegistryEventKind.PUT, "cfg", "config")]
        await asyncio.to_thread(add_to_state_file, settings, node("a"))
        await _until(lambda: any(e.node_id == "a" for e in events))
        await asyncio.to_thread(remove_from_state_file, settings, "a")
        await _until(lambda: events[-1].kind is RegistryEventKind.DELETE)
        assert events[-1].node_id == "a"
        await registry.register(node("local", 9009), ephemeral=True)
        assert events[-1].source == "local"
        assert not (settings.state_dir / "nodes.json").read_text().count("local")
        await registry.deregister("local")
        assert events[-1].kind is RegistryEventKind.DELETE
        assert registry.status().health is RegistryHealth.OK
        (settings.state_dir / "nodes.json").write_text("garbage")
        os.utime(settings.state_dir / "nodes.json", ns=(1, 1))
        await _until(lambda: registry.status().health is RegistryHealth.DEGRADED)
        assert [r.node.id for r in registry.nodes()] == ["cfg"]
    finally:
        await registry.aclose()


async def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - the registry offers no event to wait on
            await asyncio.sleep(0.01)


def test_invalid_entries_survive_a_rewrite(settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    settings.state_dir.mkdir(parents=True)
    odd = {"id": "odd", "endpoint": "http://127.0.0.1:9005", "model": "m", "engine": "vlm"}
    (settings.state_dir / "nodes.json").write_text(json.dumps({"version": 1, "nodes": [odd]}))
    add_to_state_file(settings, node("a"))
    entries = json.loads((settings.state_dir / "nodes.json").read_text())["nodes"]
    assert odd in entries and any(e["id"] == "a" for e in entries)
    assert "entry 'odd' is invalid" in caplog.text


async def test_a_state_file_node_shadowed_by_a_local_node_never_takes_it_down(settings: Settings) -> None:
    # The state file already names `local` when the daemon's own local node of that id comes up.
    add_to_state_file(settings, node("local", 9010))
    events: list[RegistryEvent] = []
    registry = EmbeddedRegistry(settings)
    await registry.start(events.append)
    try:
        await registry.register(node("local", 9009), ephemeral=True)
        assert [(r.node.id, r.source) for r in registry.nodes()] == [("cfg", "config"), ("local", "local")]
        events.clear()
        await asyncio.to_thread(add_to_state_file, settings, node("other", 9011))  # any later change
        await _until(lambda: any(e.node_id == "other" for e in events))
        await asyncio.sleep(0.1)
        assert [(e.kind, e.node_id) for e in events] == [(RegistryEventKind.PUT, "other")]
        assert ("local", "local") in [(r.node.id, r.source) for r in registry.nodes()]
    finally:
        await registry.aclose()
