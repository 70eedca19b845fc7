"""Applying, scaling, rolling out, undoing and deleting deployments in the embedded store and in a real etcd: each
change is a generation written against the one read, so concurrent writers never lose a change silently."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from qiip_core import DeploymentConflict, DeploymentInvalid, DeploymentNotFound, HostNotInPool
from qiip_core.config import HostSpec, load_settings
from qiip_core.deployments import (
    DeploymentSpec,
    DeploymentStatus,
    DeploymentStore,
    EmbeddedDeploymentStore,
    EtcdDeploymentStore,
    ResolvedSource,
    Template,
    apply,
    delete,
    parse_spec,
    rollout,
    scale,
    undo,
)
from tests.support.etcd import EtcdServer


async def resolve(spec: DeploymentSpec) -> Template:
    artifact = spec.source.artifact or "0" * 8
    return Template(
        engine=spec.engine, source=ResolvedSource(model=f"m/{artifact}.gguf", artifact_id=artifact.ljust(64, "0"))
    )


def spec(artifact: str = "aaaaaaaa", replicas: int = 2) -> DeploymentSpec:
    return parse_spec({"name": "coder", "source": {"artifact": artifact}, "replicas": replicas})


@pytest.fixture(params=["embedded", "etcd"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> DeploymentStore:
    if request.param == "embedded":
        return EmbeddedDeploymentStore(load_settings(state_dir=tmp_path))
    etcd: EtcdServer = request.getfixturevalue("etcd")
    settings = load_settings(state_dir=tmp_path, registry={"backend": "etcd"}, etcd={"endpoints": [etcd.url]})
    return EtcdDeploymentStore(settings)


async def test_apply_creates_then_changes_bump_the_generation_and_keep_history(store: DeploymentStore) -> None:
    created, changed = await apply(store, spec(), resolve=resolve)
    assert (created.generation, changed) == (1, True)
    same, changed = await apply(store, spec(), resolve=resolve)
    assert (same.generation, changed) == (1, False)  # an identical spec is no new generation
    scaled = await scale(store, "coder", 3)
    assert (scaled.generation, scaled.spec.replicas, scaled.history) == (2, 3, ())
    rolled, _ = await rollout(store, "coder", resolve=resolve, changes={"source": {"artifact": "bbbbbbbb"}})
    assert rolled.generation == 3 and rolled.history[0].hash == created.template.hash
    back = await undo(store, "coder")
    assert back.generation == 4 and back.template.hash == created.template.hash
    assert back.spec.source.artifact == "aaaaaaaa" and back.history[0].hash == rolled.template.hash
    await store.aclose()


async def test_a_stale_generation_is_refused_and_two_writers_at_once_never_both_win(store: DeploymentStore) -> None:
    await apply(store, spec(), resolve=resolve)
    with pytest.raises(DeploymentConflict, match="generation 1, not 7"):
        await apply(store, spec(replicas=5), resolve=resolve, expected_generation=7)
    with pytest.raises(DeploymentConflict, match="exists already"):
        await apply(store, spec(), resolve=resolve, expected_generation=0)
    results = await asyncio.gather(
        *(apply(store, spec(replicas=n), resolve=resolve, expected_generation=1) for n in (3, 4, 5)),
        return_exceptions=True,
    )
    won = [r for r in results if not isinstance(r, BaseException)]
    assert len(won) == 1 and all(isinstance(r, DeploymentConflict) for r in results if isinstance(r, BaseException))
    stored = await store.get("coder")
    assert stored.generation == 2 and stored.spec.replicas == won[0][0].spec.replicas
    await store.aclose()


async def test_delete_marks_the_deployment_and_refuses_changes_until_it_is_gone(store: DeploymentStore) -> None:
    await apply(store, spec(), resolve=resolve)
    marked = await delete(store, "coder")
    assert marked.deleting
    with pytest.raises(DeploymentConflict, match="being deleted"):
        await scale(store, "coder", 1)
    await store.put_status(DeploymentStatus(name="coder", desired=0))
    await store.remove("coder")
    with pytest.raises(DeploymentNotFound):
        await store.get("coder")
    assert await store.statuses() == {}
    with pytest.raises(DeploymentConflict, match="no earlier template"):
        await apply(store, spec(), resolve=resolve)
        await undo(store, "coder")
    await store.aclose()


async def test_added_hosts_are_kept_and_removed(store: DeploymentStore) -> None:
    await store.add_host(HostSpec(name="GPU01.lab", labels={"rack": "b"}, memory_mib=65536))
    assert [h.name for h in await store.hosts()] == ["gpu01.lab"]
    with pytest.raises(HostNotInPool):
        await store.remove_host("gpu02")
    await store.remove_host("gpu01.lab")
    assert await store.hosts() == []
    await store.aclose()


async def test_a_source_that_does_not_resolve_stores_nothing(tmp_path: Path) -> None:
    store = EmbeddedDeploymentStore(load_settings(state_dir=tmp_path))

    async def refuse(_: DeploymentSpec) -> Template:
        raise DeploymentInvalid("no such artifact")

    with pytest.raises(DeploymentInvalid):
        await apply(store, spec(), resolve=refuse)
    assert await store.deployments() == []
