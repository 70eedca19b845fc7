"""Changing a deployment: apply, scale, roll out, undo, delete — each a new generation written against the one read.

```
apply(store, spec, resolve=…, expected_generation=None)   create, or replace when the spec changed (+1)
scale(store, name, replicas)                              spec.replicas (+1)
rollout(store, name, source=…, engine=…, runtime=…)      a new template (+1); the old one goes to history
undo(store, name)                                         back to the newest template of the history (+1)
delete(store, name)                                       `deleting`: the controller drains, tears down, removes
resolve_source(spec, catalog, cache_dir, hub_commit=…)    artifact prefix / hub file / hub repo → exact files
```

Every function reads the stored deployment, decides, and writes with the generation it read as the precondition,
so two operators changing one deployment at once never lose a change silently: one gets 409.
"""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from qiip_core._errors import DeploymentConflict, DeploymentInvalid, DeploymentNotFound
from qiip_core._violation import Violation
from qiip_core.catalog import Catalog
from qiip_core.deployments._resource import MAX_HISTORY, Deployment, ResolvedSource, Template, utc_now
from qiip_core.deployments._spec import DeploymentSpec, parse_spec
from qiip_core.deployments._store import DeploymentStore

__all__ = ["Resolve", "apply", "delete", "resolve_source", "rollout", "scale", "undo"]

Resolve = Callable[[DeploymentSpec], Awaitable[Template]]
"""Turns a spec's engine, source and runtime into an exact template (checks the artifact exists, resolves the hub
revision, checks the sizing against the model). Raises `DeploymentInvalid` with the field at fault."""

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def _invalid(field: str, message: str) -> DeploymentInvalid:
    return DeploymentInvalid(message, violations=[Violation(field, message)])


def resolve_source(
    spec: DeploymentSpec,
    catalog: Catalog,
    cache_dir: Path,
    *,
    hub_commit: Callable[[str, str], str | None] | None = None,
) -> ResolvedSource:
    """The exact files a spec's source names, from the shared model cache's catalog.

    Args:
        spec: the spec.
        catalog: the catalog of the shared model cache (`provisioning.model_cache_dir`), which the hosts mount.
        cache_dir: that cache's root on this gateway (model paths are given to hosts relative to it).
        hub_commit: vLLM only, for a repository not in the cache: asks the hub for a revision's commit (None: the
            revision must be a commit already).

    Returns:
        The resolved source.

    Raises:
        DeploymentInvalid: no generation (or several) matches, or the revision cannot be resolved; the violation
            names the field (`source.artifact`, `source.hub.file`, `source.hub.revision`).
    """
    source = spec.source
    if source.artifact is not None:
        prefix = source.artifact
        matches = [g for g in catalog.gguf if g.artifact_id.startswith(prefix)]
        if not matches:
            raise _invalid(
                "source.artifact",
                f"No GGUF generation of the shared model cache ({cache_dir}) has an id starting with {prefix}; "
                "`qiip model list` shows them.",
            )
        if len(matches) > 1:
            listed = ", ".join(f"{g.artifact_id[:16]} ({g.repo_id} {g.entrypoint})" for g in matches[:5])
            raise _invalid(
                "source.artifact",
                f"source.artifact {prefix} matches {len(matches)} generations: {listed}; give more characters.",
            )
        found = matches[0]
        return ResolvedSource(
            model=os.path.relpath(found.entrypoint_path, cache_dir),
            artifact_id=found.artifact_id,
            revision=found.revision,
            describe=f"artifact {found.artifact_id[:12]} ({found.repo_id}@{found.revision[:7]} {found.entrypoint})",
        )
    hub = source.hub
    assert hub is not None
    if spec.engine.serves_gguf:
        candidates = [g for g in catalog.gguf if g.repo_id == hub.repo and g.entrypoint == hub.file]
        if not candidates:
            raise _invalid(
                "source.hub.file",
                f"{hub.repo} {hub.file} is not in the shared model cache ({cache_dir}); download it first "
                f"(`qiip model download {hub.repo} {hub.file} --revision {hub.revision}`).",
            )
        chosen = [g for g in candidates if g.revision == hub.revision or hub.revision in g.refs]
        if not chosen:
            have = ", ".join(
                sorted({g.revision[:7] + (f" ({', '.join(g.refs)})" if g.refs else "") for g in candidates})
            )
            raise _invalid(
                "source.hub.revision",
                f"Revision {hub.revision} of {hub.repo} {hub.file} is not in the shared model cache (it holds {have}).",
            )
        found = chosen[0]
        return ResolvedSource(
            model=os.path.relpath(found.entrypoint_path, cache_dir),
            artifact_id=found.artifact_id,
            revision=found.revision,
            describe=f"{hub.repo}@{found.revision[:7]} {hub.file} (artifact {found.artifact_id[:12]})",
        )
    commit: str | None = hub.revision if _COMMIT_RE.match(hub.revision) else None
    for full in catalog.full:
        if full.repo_id == hub.repo and (full.revision == hub.revision or hub.revision in full.refs):
            commit = full.revision
    if commit is None and hub_commit is not None:
        commit = hub_commit(hub.repo, hub.revision)
    if commit is None:
        raise _invalid(
            "source.hub.revision",
            f"Revision {hub.revision} of {hub.repo} cannot be resolved to a commit: the repository is not in the "
            "shared model cache and the hub did not answer; give a 40-hex commit.",
        )
    return ResolvedSource(model=hub.repo, revision=commit, describe=f"{hub.repo}@{commit[:7]}")


def _written(spec: DeploymentSpec) -> dict[str, Any]:
    return spec.source.model_dump(mode="json", exclude_none=True)


async def apply(
    store: DeploymentStore,
    spec: DeploymentSpec,
    *,
    resolve: Resolve,
    expected_generation: int | None = None,
) -> tuple[Deployment, bool]:
    """Create the deployment, or replace its spec.

    Args:
        store: where deployments live.
        spec: the checked spec.
        resolve: turns the spec into its exact template.
        expected_generation: the generation the caller read (0: it must not exist); None: whatever is stored now
            (read here, and still written against it).

    Returns:
        The stored deployment, and whether anything changed (an identical spec keeps its generation).

    Raises:
        DeploymentInvalid: the source or the sizing does not resolve.
        DeploymentConflict: the generation read is not the stored one, or the deployment is being deleted.
        DeploymentNotFound: a generation was expected, but the deployment does not exist.
    """
    current: Deployment | None
    try:
        current = await store.get(spec.name)
    except DeploymentNotFound:
        current = None
    if expected_generation is not None:
        if expected_generation == 0 and current is not None:
            raise DeploymentConflict(f"Deployment {spec.name!r} exists already (generation {current.generation}).")
        if expected_generation > 0 and current is None:
            raise DeploymentNotFound(spec.name)
        if current is not None and expected_generation > 0 and current.generation != expected_generation:
            raise DeploymentConflict(
                f"Deployment {spec.name!r} is at generation {current.generation}, not {expected_generation}: it "
                "changed since it was read. Read it again and re-apply."
            )
    if current is not None and current.deleting:
        raise DeploymentConflict(f"Deployment {spec.name!r} is being deleted; apply it again once it is gone.")
    template = (await resolve(spec)).model_copy(update={"written": _written(spec)})
    if current is None:
        created = Deployment(spec=spec, template=template)
        return await store.write(created, expected_generation=0), True
    if current.spec == spec and current.template.hash == template.hash:
        return current, False
    history = current.history
    if template.hash != current.template.hash:
        history = ((current.template,) + tuple(t for t in current.history if t.hash != template.hash))[:MAX_HISTORY]
    changed = current.model_copy(
        update={
            "spec": spec,
            "template": template,
            "history": history,
            "generation": current.generation + 1,
            "updated_at": utc_now(),
        }
    )
    return await store.write(changed, expected_generation=current.generation), True


async def _change(
    store: DeploymentStore, name: str, expected_generation: int | None, change: Callable[[Deployment], Deployment]
) -> Deployment:
    current = await store.get(name)
    if expected_generation is not None and current.generation != expected_generation:
        raise DeploymentConflict(
            f"Deployment {name!r} is at generation {current.generation}, not {expected_generation}: it changed since "
            "it was read."
        )
    if current.deleting:
        raise DeploymentConflict(f"Deployment {name!r} is being deleted.")
    changed = change(current)
    if changed == current:
        return current
    return await store.write(changed, expected_generation=current.generation)


async def scale(
    store: DeploymentStore, name: str, replicas: int, *, expected_generation: int | None = None
) -> Deployment:
    """Set `spec.replicas`.

    Raises:
        DeploymentInvalid: `replicas` is out of range.
        DeploymentNotFound, DeploymentConflict: as `apply`.
    """
    if not 0 <= replicas <= 1000:
        raise _invalid("replicas", f"replicas must be a whole number from 0 to 1000, got {replicas}.")

    def change(current: Deployment) -> Deployment:
        if current.spec.replicas == replicas:
            return current
        spec = current.spec.model_copy(update={"replicas": replicas})
        return current.model_copy(update={"spec": spec, "generation": current.generation + 1, "updated_at": utc_now()})

    return await _change(store, name, expected_generation, change)


async def rollout(
    store: DeploymentStore,
    name: str,
    *,
    resolve: Resolve,
    changes: Mapping[str, Any],
    expected_generation: int | None = None,
) -> tuple[Deployment, bool]:
    """Roll out a new source, engine or runtime: the spec with `changes` applied (`{"source": {...}}`, …).

    Raises:
        DeploymentInvalid: a change breaks a rule, or names a field other than source, engine and runtime.
        DeploymentNotFound, DeploymentConflict: as `apply`.
    """
    unknown = sorted(set(changes) - {"source", "engine", "runtime"})
    if unknown:
        raise _invalid(unknown[0], f"A rollout changes source, engine or runtime; {unknown[0]} is not one of them.")
    current = await store.get(name)
    data = current.spec.model_dump(mode="json", exclude_none=True)
    data.update(changes)
    spec = parse_spec(data)
    return await apply(store, spec, resolve=resolve, expected_generation=expected_generation or current.generation)


async def undo(store: DeploymentStore, name: str, *, expected_generation: int | None = None) -> Deployment:
    """Go back to the newest template of the history (its source as written, its engine and runtime).

    Raises:
        DeploymentConflict: there is no earlier template, or as `apply`.
        DeploymentNotFound: as `apply`.
    """

    def change(current: Deployment) -> Deployment:
        if not current.history:
            raise DeploymentConflict(f"Deployment {name!r} has no earlier template to go back to.")
        previous, rest = current.history[0], current.history[1:]
        data = current.spec.model_dump(mode="json", exclude_none=True)
        data.update({"engine": previous.engine, "source": previous.written or data["source"]})
        data["runtime"] = previous.runtime.model_dump(mode="json", exclude_none=True)
        spec = parse_spec(data)
        return current.model_copy(
            update={
                "spec": spec,
                "template": previous,
                "history": ((current.template,) + rest)[:MAX_HISTORY],
                "generation": current.generation + 1,
                "updated_at": utc_now(),
            }
        )

    return await _change(store, name, expected_generation, change)


async def delete(store: DeploymentStore, name: str) -> Deployment:
    """Mark the deployment for deletion: the controller drains and tears down its replicas, then removes it.

    Raises:
        DeploymentNotFound: there is none.
    """
    current = await store.get(name)
    if current.deleting:
        return current
    return await store.write(current.model_copy(update={"deleting": True}), expected_generation=current.generation)
