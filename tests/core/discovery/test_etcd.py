"""The etcd registry against a real etcd: snapshot, watch, revisions, hostile values, compaction, leases."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import etcd3gw
import pytest

from qiip_core.config import Settings, load_settings
from qiip_core.discovery import (
    LAST_KNOWN_FILE,
    EtcdRegistry,
    RegistryEvent,
    RegistryEventKind,
    RegistryHealth,
    decode_node,
    encode_node,
)
from qiip_core.nodes import EndpointPolicy, Node
from tests.support.daemon import free_port
from tests.support.etcd import EtcdServer

pytestmark = pytest.mark.integration


def settings_for(etcd: EtcdServer, tmp_path: Path, **etcd_overrides: object) -> Settings:
    return load_settings(
        state_dir=tmp_path,
        registry={"backend": "etcd"},
        etcd={"endpoints": [etcd.url], "reconnect_max_backoff_s": 0.5, **etcd_overrides},
    )


def raw_client(etcd: EtcdServer) -> Any:
    return etcd3gw.client(host="127.0.0.1", port=etcd.client_port, timeout=5)


def value(endpoint: str, model: str = "m", **extra: object) -> str:
    return json.dumps({"endpoint": endpoint, "model": model, "engine": "vllm", **extra})


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polling what a background task builds
            await asyncio.sleep(0.02)


class Recorder:
    def __init__(self) -> None:
        self.events: list[RegistryEvent] = []
        self.nodes: dict[str, Node] = {}

    def __call__(self, event: RegistryEvent) -> None:
        self.events.append(event)
        if event.kind is RegistryEventKind.PUT and event.node is not None:
            self.nodes[event.node_id] = event.node
        else:
            self.nodes.pop(event.node_id, None)


@pytest.fixture
async def registry(etcd: EtcdServer, tmp_path: Path) -> AsyncIterator[tuple[EtcdRegistry, Recorder]]:
    reg = EtcdRegistry(settings_for(etcd, tmp_path))
    recorder = Recorder()
    await reg.start(recorder)
    try:
        yield reg, recorder
    finally:
        await reg.aclose()


def test_value_codec_is_seed_compatible() -> None:
    policy = EndpointPolicy()
    node = decode_node(
        "gpu01",
        b'{"endpoint":"127.0.0.1:8000","status":"healthy","model":"Qwen/Q:8b","engine":"llama_cpp",'
        b'"capabilities":{"max_tokens":4096,"gpu_memory":""},"active_connections":3,"future_field":1}',
        policy,
        max_value_bytes=4096,
    )
    assert node.id == "gpu01" and node.endpoint == "http://127.0.0.1:8000" and node.managed is False
    assert "id" not in json.loads(encode_node(node))
    for bad, reason in [
        (b"not json", "not JSON"),
        (b"[1]", "not a JSON object"),
        (b'{"endpoint":"127.0.0.1:1","model":"m","engine":"tgi"}', "engine"),
        (b'{"endpoint":"127.0.0.1:1","model":5}', "model"),
        (b'{"endpoint":"http://10.0.0.1:8000","model":"m"}', "outside the allowlist"),
        (b'{"endpoint":"127.0.0.1:1","model":"m","x":"' + b"a" * 5000 + b'"}', "over the limit"),
    ]:
        with pytest.raises(ValueError, match=reason):
            decode_node("n", bad, policy, max_value_bytes=4096)


async def test_snapshot_then_watch(etcd: EtcdServer, tmp_path: Path) -> None:
    client = raw_client(etcd)
    client.put("/nodes/before", value("http://127.0.0.1:9001"))
    client.put("/other/ignored", value("http://127.0.0.1:9009"))
    reg = EtcdRegistry(settings_for(etcd, tmp_path))
    recorder = Recorder()
    await reg.start(recorder)
    try:
        assert list(recorder.nodes) == ["before"] and reg.status().health is RegistryHealth.OK
        client.put("/nodes/after", value("http://127.0.0.1:9002", "m2"))
        await until(lambda: "after" in recorder.nodes)
        assert recorder.nodes["after"].model == "m2"
        client.delete("/nodes/before")
        await until(lambda: "before" not in recorder.nodes)
        assert recorder.events[-1].kind is RegistryEventKind.DELETE
    finally:
        await reg.aclose()


async def test_hostile_values_are_skipped_and_never_deletes(
    registry: tuple[EtcdRegistry, Recorder], etcd: EtcdServer
) -> None:
    reg, recorder = registry
    client = raw_client(etcd)
    client.put("/nodes/good", value("http://127.0.0.1:9001"))
    await until(lambda: "good" in recorder.nodes)
    for key, raw in [
        ("/nodes/huge", value("http://127.0.0.1:9002", padding="x" * 300_000)),
        ("/nodes/types", json.dumps({"endpoint": ["no"], "model": {"a": 1}})),
        ("/nodes/outside", value("http://192.168.1.10:8000")),
        ("/nodes/engine", json.dumps({"endpoint": "http://127.0.0.1:9003", "model": "m", "engine": "tgi"})),
        ("/nodes/garbage", "\x00\xff{"),
        ("/nodes/good", "{not json"),
    ]:
        client.put(key, raw)
    client.put("/nodes/last", value("http://127.0.0.1:9004"))
    await until(lambda: "last" in recorder.nodes)
    assert sorted(recorder.nodes) == ["good", "last"]
    assert recorder.nodes["good"].endpoint == "http://127.0.0.1:9001"
    assert not any(e.kind is RegistryEventKind.DELETE for e in recorder.events)


async def test_older_revisions_never_overwrite_newer(registry: tuple[EtcdRegistry, Recorder], etcd: EtcdServer) -> None:
    reg, recorder = registry
    client = raw_client(etcd)
    client.put("/nodes/a", value("http://127.0.0.1:9001", "v1"))
    client.put("/nodes/a", value("http://127.0.0.1:9001", "v2"))
    await until(lambda: recorder.nodes.get("a") is not None and recorder.nodes["a"].model == "v2")
    stale = {"key": "L25vZGVzL2E=", "mod_revision": "1", "value": "e30="}
    reg._follower._on_watch_message({"result": {"events": [{"kv": stale}]}})
    assert recorder.nodes["a"].model == "v2"


async def test_compaction_past_the_watch_recovers_by_snapshot(etcd: EtcdServer, tmp_path: Path) -> None:
    client = raw_client(etcd)
    client.put("/nodes/gone", value("http://127.0.0.1:9001"))
    reg = EtcdRegistry(settings_for(etcd, tmp_path))
    recorder = Recorder()
    reg._on_event = recorder
    await reg._follower.snapshot()
    stale_revision = reg._follower.revision
    client.delete("/nodes/gone")
    client.put("/nodes/new", value("http://127.0.0.1:9002"))
    head = int(client.post(client.get_url("/kv/range"), json={"key": "L25vZGVzL25ldw=="})["header"]["revision"])
    client.post(client.get_url("/kv/compaction"), json={"revision": head, "physical": True})
    reg._follower._revision = stale_revision
    try:
        async with asyncio.timeout(10):
            await reg._follower._watch()  # returns instead of raising: the watch start is compacted
        await reg._follower.snapshot()
        assert list(recorder.nodes) == ["new"]
    finally:
        await reg.aclose()


async def test_outage_keeps_the_last_view_and_recovers(
    registry: tuple[EtcdRegistry, Recorder], etcd: EtcdServer
) -> None:
    reg, recorder = registry
    raw_client(etcd).put("/nodes/a", value("http://127.0.0.1:9001"))
    await until(lambda: "a" in recorder.nodes)
    etcd.stop()
    await until(lambda: reg.status().health is RegistryHealth.DEGRADED)
    assert "a" in recorder.nodes and [r.node.id for r in reg.nodes()] == ["a"]
    etcd.start()
    raw_client(etcd).put("/nodes/b", value("http://127.0.0.1:9002"))
    await until(lambda: "b" in recorder.nodes, 20)
    assert reg.status().health is RegistryHealth.OK


async def test_a_saved_fleet_is_checked_entry_by_entry_and_served_only_while_etcd_is_down(tmp_path: Path) -> None:
    settings = load_settings(
        state_dir=tmp_path, registry={"backend": "etcd"}, etcd={"endpoints": [f"http://127.0.0.1:{free_port()}"]}
    )
    saved = tmp_path / LAST_KNOWN_FILE
    good = {"id": "a", "mod_revision": 5, "lease": 0, "value": value("http://127.0.0.1:9001")}
    outside = {"id": "b", "mod_revision": 6, "lease": 0, "value": value("http://10.0.0.1:9002")}  # not allowed
    broken = {"id": "c", "mod_revision": "x", "lease": 0, "value": value("http://127.0.0.1:9003")}
    document = {"version": 1, "saved_at": "2026-12-01T12:00:00+00:00", "prefix": "/nodes/", "revision": 9}
    saved.write_text(json.dumps({**document, "nodes": [good, outside, broken]}))
    reg, recorder = EtcdRegistry(settings), Recorder()
    await reg.start(recorder)
    try:
        assert list(recorder.nodes) == ["a"] and recorder.events[0].source == "etcd"
        status = reg.status()
        assert status.health is RegistryHealth.DEGRADED and status.last_known_at == datetime(
            2026, 12, 1, 12, tzinfo=UTC
        )
        assert "Serving the last known fleet (1 node(s), saved 2026-12-01T12:00:00+00:00)" in status.detail
    finally:
        await reg.aclose()
    # Served, never rewritten: only what etcd gives is saved.
    assert json.loads(saved.read_text())["nodes"] == [good, outside, broken]
    for unusable in (json.dumps({**document, "prefix": "/other/", "nodes": [good]}), "{not json"):
        saved.write_text(unusable)
        reg, recorder = EtcdRegistry(settings), Recorder()
        await reg.start(recorder)
        try:
            assert recorder.nodes == {} and reg.status().last_known_at is None
        finally:
            await reg.aclose()


async def test_managed_registration_carries_a_lease_and_is_refreshed(
    registry: tuple[EtcdRegistry, Recorder], etcd: EtcdServer
) -> None:
    reg, recorder = registry
    node = Node(id="m1", endpoint="127.0.0.1:9001", model="m", managed=True)
    await reg.register(node)
    await until(lambda: "m1" in recorder.nodes)
    kv = raw_client(etcd).get_prefix("/nodes/m1")[0][1]
    assert int(kv["lease"]) != 0
    external = Node(id="e1", endpoint="127.0.0.1:9002", model="m")
    await reg.register(external)
    assert int(raw_client(etcd).get_prefix("/nodes/e1")[0][1].get("lease", 0)) == 0
    await reg.node_healthy("m1")
    await reg.deregister("e1")
    await until(lambda: "e1" not in recorder.nodes)


async def test_unleased_managed_key_is_adopted_after_a_healthy_probe(
    registry: tuple[EtcdRegistry, Recorder], etcd: EtcdServer
) -> None:
    reg, recorder = registry
    client = raw_client(etcd)
    client.put("/nodes/orphan", value("http://127.0.0.1:9001", managed=True))
    await until(lambda: "orphan" in recorder.nodes)
    await reg.node_healthy("orphan")
    assert int(client.get_prefix("/nodes/orphan")[0][1]["lease"]) != 0


async def test_expired_lease_removes_the_node(registry: tuple[EtcdRegistry, Recorder], etcd: EtcdServer) -> None:
    reg, recorder = registry
    client = raw_client(etcd)
    lease = client.lease(ttl=2)
    client.put("/nodes/short", value("http://127.0.0.1:9001", managed=True), lease=lease)
    await until(lambda: "short" in recorder.nodes)
    await until(lambda: "short" not in recorder.nodes, 15)


async def test_etcd_authentication(etcd: EtcdServer, tmp_path: Path) -> None:
    import shutil
    import subprocess

    etcdctl = shutil.which("etcdctl")
    assert etcdctl is not None, "etcdctl (Debian package etcd-client) is needed"

    def ctl(*args: str) -> None:
        subprocess.run(
            [etcdctl, f"--endpoints={etcd.url}", *args], check=True, capture_output=True, env={"ETCDCTL_API": "3"}
        )

    ctl("user", "add", "root:root-password")
    ctl("role", "add", "qiip")
    ctl("role", "grant-permission", "qiip", "--prefix=true", "readwrite", "/nodes/")
    ctl("user", "add", "qiip:qiip-password")
    ctl("user", "grant-role", "qiip", "qiip")
    ctl("auth", "enable")
    good = settings_for(etcd, tmp_path, username="qiip", password="qiip-password")
    reg = EtcdRegistry(good)
    recorder = Recorder()
    await reg.start(recorder)
    try:
        await reg.register(Node(id="n1", endpoint="127.0.0.1:9001", model="m"))
        await until(lambda: "n1" in recorder.nodes)
        assert reg.status().health is RegistryHealth.OK
    finally:
        await reg.aclose()
    bad = EtcdRegistry(settings_for(etcd, tmp_path, username="qiip", password="wrong"))
    await bad.start(Recorder())
    try:
        status = bad.status()
        assert status.health is RegistryHealth.DEGRADED and "refused the credentials of user 'qiip'" in status.detail
        assert "wrong" not in status.detail
    finally:
        await bad.aclose()
