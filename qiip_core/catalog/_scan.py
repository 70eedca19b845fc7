"""Scan the Hugging Face cache into a catalog: GGUF generations, full safetensors models, and what is wrong.

The layout is huggingface_hub's (`models--ORG--NAME/{blobs,snapshots/<commit>,refs}`), read with its own
`scan_cache_dir`; completeness of a safetensors model is checked with its local-files-only resolution
(`try_to_load_from_cache`), so the catalog sees exactly what a `from_pretrained(..., local_files_only=True)`
would. GGUF headers are read and checked as a launch checks them (`inspect_model`: whole, within bounds, an
architecture llama.cpp loads, the tensors it needs), so a generation offered here is one a node can be launched on;
the planner says whether it models the architecture.

Grouping, per snapshot:

- every `.gguf` whose name is not a shard name is one generation;
- `NAME-0000k-of-0000N.gguf` files with the same directory, NAME and N form a family: all N present is one
  generation whose entrypoint is shard 1; fewer is an `incomplete` issue, never offered;
- a snapshot with `*.safetensors` (and its `model.safetensors.index.json`, when sharded) and `config.json` is one
  full model; a shard the index lists but the cache lacks makes it `incomplete`.

A snapshot link whose blob is gone (pruned from a shared cache) makes huggingface_hub give up on the whole
repository. The catalog reads such a repository again itself, file by file: every file whose blob is there is
offered as usual, and each broken link is an `incomplete` issue naming the file, so one missing blob never hides
the rest (nor marks the scan degraded). Only what cannot be read at all (a ref to a commit the cache does not hold,
a snapshot that is a file) stays `corrupted`.

Reading a header costs a few hundred microseconds; results are kept per blob (path, size, modification time), so
a rescan of an unchanged cache reads nothing but directory entries.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qiip_core._errors import ArtifactNotFound, ModelFileError
from qiip_core.catalog._types import (
    Catalog,
    CatalogIssue,
    FullModel,
    GgufGeneration,
    IssueKind,
    artifact_id,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from huggingface_hub import CachedFileInfo, CachedRevisionInfo

__all__ = ["default_cache_dir", "resolve_artifact", "scan_catalog", "verify_generation"]

logger = logging.getLogger("qiip.catalog")

_SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_SAFETENSORS_INDEX = "model.safetensors.index.json"

_METADATA_CACHE_SIZE = 4096
"""Header summaries kept between scans (one per GGUF generation)."""


@dataclass(frozen=True, slots=True)
class _Summary:
    architecture: str
    quantization: str | None
    context_length: int
    modelled: bool


_summaries: collections.OrderedDict[tuple[str, int, int], _Summary | str] = collections.OrderedDict()
_summaries_lock = threading.Lock()


def default_cache_dir() -> Path:
    """huggingface_hub's cache directory (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def scan_catalog(cache_dir: Path | None = None) -> Catalog:
    """Scan the Hugging Face cache.

    Blocking (directory walks, header reads): run it in a thread from async code.

    Args:
        cache_dir: the hub cache; None for huggingface_hub's default (`default_cache_dir()`).

    Returns:
        The catalog. A missing cache directory gives an empty catalog with `exists` False; a repository whose layout
        cannot be read is a `corrupted` issue and makes the catalog `degraded`.

    Raises:
        OSError: the cache directory exists but cannot be listed.
    """
    from huggingface_hub import CacheNotFound, scan_cache_dir

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        info = scan_cache_dir(root)
    except CacheNotFound:
        return Catalog(cache_dir=root, gguf=(), full=(), issues=(), repos=0, files=0, exists=False)
    except ValueError as exc:  # the path is a file, not a directory
        raise OSError(f"The Hugging Face cache {root} is not a directory: {exc}") from exc
    generations: list[GgufGeneration] = []
    full: list[FullModel] = []
    issues: list[CatalogIssue] = []
    scanned: list[tuple[str, str, Iterable[CachedRevisionInfo]]] = [
        (r.repo_id, r.repo_type, r.revisions) for r in info.repos
    ]
    for warning in info.warnings:
        repo_dir = _repo_dir_of(root, str(warning))
        tolerant = _read_repo_tolerantly(repo_dir) if repo_dir is not None else None
        if tolerant is None:
            issues.append(
                CatalogIssue(IssueKind.CORRUPTED, _repo_of(str(warning)), None, (), f"{warning}".rstrip(".") + ".")
            )
            continue
        repo_id, revisions, broken = tolerant
        scanned.append((repo_id, "model", revisions))
        for commit, name, blob in broken:
            issues.append(
                CatalogIssue(
                    IssueKind.INCOMPLETE,
                    repo_id,
                    commit,
                    (name,),
                    f"{name} links to the blob {blob}, which is missing (pruned from a shared cache?); the other "
                    "files of the snapshot are offered. Download the file again to restore it.",
                )
            )
    repos = files = 0
    for repo_id, repo_type, repo_revisions in sorted(scanned, key=lambda r: r[0]):
        if repo_type != "model":
            continue
        repos += 1
        for revision in sorted(repo_revisions, key=lambda r: r.commit_hash):
            files += len(revision.files)
            _scan_revision(root, repo_id, revision, generations, full, issues)
    return Catalog(
        cache_dir=root,
        gguf=tuple(generations),
        full=tuple(full),
        issues=tuple(issues),
        repos=repos,
        files=files,
    )


def _repo_dir_of(root: Path, warning: str) -> Path | None:
    """The repository folder a "Blob missing (broken symlink)" warning is about, or None for any other warning."""
    if "broken symlink" not in warning:
        return None
    match = re.search(r"/(models--[^/]+)/", warning)
    return root / match.group(1) if match else None


def _read_repo_tolerantly(
    repo_dir: Path,
) -> tuple[str, list[CachedRevisionInfo], list[tuple[str, str, str]]] | None:
    """Read a model repository of the cache as huggingface_hub's `scan_cache_dir` does, but skip broken snapshot
    links instead of giving up on the repository.

    Returns:
        `(repo_id, revisions, [(commit, file name, missing blob name)])`, or None when the layout is broken in
        another way (no snapshots folder, a snapshot that is a file, a ref to a commit that is not cached).
    """
    from huggingface_hub import CachedFileInfo, CachedRevisionInfo

    prefix, _, name = repo_dir.name.partition("--")
    snapshots, refs = repo_dir / "snapshots", repo_dir / "refs"
    if prefix != "models" or not name or not snapshots.is_dir():
        return None
    refs_by_commit: dict[str, set[str]] = collections.defaultdict(set)
    try:
        for ref in refs.glob("**/*") if refs.is_dir() else ():
            if ref.is_file():
                refs_by_commit[ref.read_text()].add(ref.relative_to(refs).as_posix())
        revisions: list[CachedRevisionInfo] = []
        broken: list[tuple[str, str, str]] = []
        for snapshot in sorted(snapshots.iterdir()):
            if not snapshot.is_dir():
                return None
            cached = []
            for path in sorted(snapshot.glob("**/*")):
                if path.is_dir():
                    continue
                blob = Path(os.path.abspath(path.parent / os.readlink(path))) if path.is_symlink() else path
                if not blob.exists():
                    broken.append((snapshot.name, path.relative_to(snapshot).as_posix(), blob.name))
                    continue
                stat = blob.stat()
                cached.append(
                    CachedFileInfo(
                        file_name=path.name,
                        file_path=path,
                        blob_path=blob,
                        size_on_disk=stat.st_size,
                        blob_last_accessed=stat.st_atime,
                        blob_last_modified=stat.st_mtime,
                    )
                )
            revisions.append(
                CachedRevisionInfo(
                    commit_hash=snapshot.name,
                    snapshot_path=snapshot,
                    size_on_disk=sum(f.size_on_disk for f in cached),
                    files=frozenset(cached),
                    refs=frozenset(refs_by_commit.pop(snapshot.name, set())),
                    last_modified=max((f.blob_last_modified for f in cached), default=0.0),
                )
            )
    except OSError:
        return None
    if refs_by_commit:
        return None
    return name.replace("--", "/"), revisions, broken


def _repo_of(warning: str) -> str:
    match = re.search(r"models--([\w.-]+)", warning)
    return match.group(1).replace("--", "/", 1) if match else "?"


def _scan_revision(
    root: Path,
    repo_id: str,
    revision: CachedRevisionInfo,
    generations: list[GgufGeneration],
    full: list[FullModel],
    issues: list[CatalogIssue],
) -> None:
    commit = revision.commit_hash
    refs = tuple(sorted(revision.refs))
    by_name: dict[str, CachedFileInfo] = {
        f.file_path.relative_to(revision.snapshot_path).as_posix(): f for f in revision.files
    }
    families: dict[tuple[str, str, int], dict[int, str]] = collections.defaultdict(dict)
    standalone: list[str] = []
    for name in sorted(by_name):
        if not name.lower().endswith(".gguf"):
            continue
        directory, _, base = name.rpartition("/")
        match = _SHARD_RE.match(base)
        if match is None:
            standalone.append(name)
        else:
            families[(directory, match["prefix"], int(match["count"]))][int(match["no"])] = name
    candidates: list[tuple[str, tuple[str, ...]]] = [(name, (name,)) for name in standalone]
    for (directory, prefix, count), shards in sorted(families.items()):
        missing = [n for n in range(1, count + 1) if n not in shards]
        if missing or count == 0 or max(shards) > count:
            where = f"{directory}/" if directory else ""
            absent = ", ".join(f"{where}{prefix}-{n:05d}-of-{count:05d}.gguf" for n in missing[:3])
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            issues.append(
                CatalogIssue(
                    IssueKind.INCOMPLETE,
                    repo_id,
                    commit,
                    tuple(shards[n] for n in sorted(shards)),
                    f"{len(shards)} of the {count} shards of {where}{prefix} are cached; missing {absent}{more}.",
                )
            )
            continue
        candidates.append((shards[1], tuple(shards[n] for n in range(1, count + 1))))
    for entrypoint, names in sorted(candidates):
        infos = [by_name[n] for n in names]
        summary = _summary(infos[0])
        if isinstance(summary, str):
            issues.append(CatalogIssue(IssueKind.INVALID, repo_id, commit, names, summary))
            continue
        verifiable = all(f.file_path.is_symlink() and _SHA256_RE.match(f.blob_path.name) for f in infos)
        generation = GgufGeneration(
            artifact_id=artifact_id(repo_id=repo_id, revision=commit, files=names, entrypoint=entrypoint),
            repo_id=repo_id,
            revision=commit,
            refs=refs,
            entrypoint=entrypoint,
            files=tuple(sorted(names)),
            entrypoint_path=infos[0].file_path,
            size_bytes=sum(f.size_on_disk for f in infos),
            architecture=summary.architecture,
            quantization=summary.quantization,
            context_length=summary.context_length,
            modelled=summary.modelled,
            verifiable=verifiable,
            blobs=tuple(by_name[n].blob_path for n in sorted(names)),
        )
        generations.append(generation)
        if not verifiable:
            issues.append(
                CatalogIssue(
                    IssueKind.UNVERIFIABLE,
                    repo_id,
                    commit,
                    names,
                    f"{entrypoint} is offered, but its bytes cannot be checked: the snapshot holds a copy or a "
                    "non-LFS blob, not a link to a blob named by its SHA-256.",
                )
            )
    _scan_full(root, repo_id, revision, commit, refs, by_name, full, issues)


def _scan_full(
    root: Path,
    repo_id: str,
    revision: CachedRevisionInfo,
    commit: str,
    refs: tuple[str, ...],
    by_name: dict[str, CachedFileInfo],
    full: list[FullModel],
    issues: list[CatalogIssue],
) -> None:
    from huggingface_hub import try_to_load_from_cache

    weights = sorted(n for n in by_name if "/" not in n and n.endswith(".safetensors"))
    index = by_name.get(_SAFETENSORS_INDEX)
    if not weights and index is None:
        return
    required = {"config.json"}
    if index is not None:
        entrypoint = _SAFETENSORS_INDEX
        try:
            weight_map = json.loads(index.file_path.read_text(encoding="utf-8"))["weight_map"]
            required |= {str(shard) for shard in weight_map.values()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            issues.append(
                CatalogIssue(
                    IssueKind.INVALID,
                    repo_id,
                    commit,
                    (_SAFETENSORS_INDEX,),
                    f"{_SAFETENSORS_INDEX} has no readable weight_map ({exc.__class__.__name__}).",
                )
            )
            return
    else:
        entrypoint = "model.safetensors" if "model.safetensors" in weights else weights[0]
        required |= set(weights)
    missing = sorted(
        name
        for name in required
        if not isinstance(try_to_load_from_cache(repo_id, name, cache_dir=root, revision=commit), str)
    )
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        issues.append(
            CatalogIssue(
                IssueKind.INCOMPLETE,
                repo_id,
                commit,
                tuple(sorted(n for n in required if n in by_name)),
                f"The safetensors model lacks {shown} in the cache.",
            )
        )
        return
    names = tuple(sorted(by_name))
    full.append(
        FullModel(
            artifact_id=artifact_id(repo_id=repo_id, revision=commit, files=names, entrypoint=entrypoint),
            repo_id=repo_id,
            revision=commit,
            refs=refs,
            entrypoint=entrypoint,
            files=names,
            snapshot_path=revision.snapshot_path,
            size_bytes=sum(f.size_on_disk for f in by_name.values()),
        )
    )


def _summary(info: CachedFileInfo) -> _Summary | str:
    """The header facts of a GGUF (or of a split family's shard 1), or why it cannot be read."""
    try:
        stat = info.blob_path.stat()
    except OSError as exc:
        return f"{info.file_name} cannot be read: {exc.strerror}."
    key = (str(info.blob_path), stat.st_size, stat.st_mtime_ns)
    with _summaries_lock:
        cached = _summaries.get(key)
        if cached is not None:
            _summaries.move_to_end(key)
            return cached
    result = _read_summary(info.file_path)
    with _summaries_lock:
        _summaries[key] = result
        while len(_summaries) > _METADATA_CACHE_SIZE:
            _summaries.popitem(last=False)
    return result


def _read_summary(path: Path) -> _Summary | str:
    from qiip_core.engines.llamacpp import inspect_model
    from qiip_core.planner import is_modelled

    try:
        metadata, shape = inspect_model(path)
    except ModelFileError as exc:
        return exc.message.replace(str(path.parent) + "/", "")
    try:
        modelled = is_modelled(shape)
    except (ValueError, KeyError, TypeError):
        modelled = False
    return _Summary(
        architecture=metadata.architecture,
        quantization=_quantization(metadata.values.get("general.file_type")),
        context_length=metadata.n_ctx_train,
        modelled=modelled,
    )


def _quantization(file_type: object) -> str | None:
    """`general.file_type` as llama.cpp names it (`LLAMA_FTYPE_MOSTLY_Q4_K_M` → `Q4_K_M`)."""
    from gguf import LlamaFileType

    if not isinstance(file_type, int):
        return None
    try:
        name = LlamaFileType(file_type).name
    except ValueError:
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def resolve_artifact(artifact: str, cache_dir: Path | None = None) -> Path:
    """The entrypoint of the GGUF generation `artifact` (what `llama-server --model` takes).

    Args:
        artifact: an `artifact_id` from the catalog.
        cache_dir: the hub cache; None for huggingface_hub's default.

    Returns:
        The entrypoint's path in its snapshot.

    Raises:
        ArtifactNotFound: no offered generation of the cache has this id (an incomplete or invalid one is never
            offered).
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    generation = scan_catalog(root).generation(artifact)
    if generation is None:
        raise ArtifactNotFound(artifact, root)
    return generation.entrypoint_path


def verify_generation(generation: GgufGeneration) -> dict[str, bool | None]:
    """Hash each file of a generation and compare with the SHA-256 its blob is named by.

    Args:
        generation: a generation from `scan_catalog`.

    Returns:
        `{file name: matches}`: True when its bytes hash to the SHA-256 its blob is named by, False when they do
        not (or it cannot be read), None when it cannot be checked (its blob is not named by a SHA-256: an
        `unverifiable` entry of the catalog).
    """
    import hashlib

    results: dict[str, bool | None] = {}
    for name, blob in zip(generation.files, generation.blobs, strict=True):
        if not _SHA256_RE.match(blob.name):
            results[name] = None
            continue
        digest = hashlib.sha256()
        try:
            with blob.open("rb") as handle:
                while block := handle.read(1 << 20):
                    digest.update(block)
        except OSError:
            results[name] = False
            continue
        results[name] = digest.hexdigest() == blob.name
    return results
