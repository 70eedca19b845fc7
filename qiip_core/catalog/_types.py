"""What the catalog reports: GGUF generations, full (safetensors) models, and the entries it will not offer.

Every value is plain data (frozen dataclasses with a `view()` for JSON), so the daemon, the CLI and the console
show the same thing the same way.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from qiip_core._errors import ArtifactAmbiguous, ArtifactIdInvalid

__all__ = [
    "ARTIFACT_ID_RE",
    "ARTIFACT_PREFIX_RE",
    "Catalog",
    "CatalogIssue",
    "FullModel",
    "GgufGeneration",
    "IssueKind",
    "artifact_id",
    "match_artifact_id",
]

ARTIFACT_ID_RE = r"^[0-9a-f]{64}$"
"""An `artifact_id`: 64 lower-case hexadecimal characters."""

ARTIFACT_PREFIX_RE = r"^[0-9a-f]{8,64}$"
"""What every command and route takes for an `artifact_id`: the whole id, or its first 8 or more characters (as git
and docker take an object's id)."""


def match_artifact_id(given: str, known: Iterable[str]) -> str | None:
    """The one id of `known` that `given` names: `given` itself, or the only one it is a prefix of.

    Args:
        given: what an operator typed: 8 to 64 lower-case hexadecimal characters.
        known: every artifact id there is to name.

    Returns:
        The whole id, or None when none matches.

    Raises:
        ArtifactIdInvalid: `given` is not 8 to 64 lower-case hexadecimal characters.
        ArtifactAmbiguous: `given` is a prefix of several ids (`.matches` lists them, sorted).
    """
    if not re.fullmatch(ARTIFACT_PREFIX_RE, given):
        raise ArtifactIdInvalid(given)
    matches = sorted({k for k in known if k.startswith(given)})
    if len(matches) > 1:
        raise ArtifactAmbiguous(given, matches)
    return matches[0] if matches else None


def artifact_id(*, repo_id: str, revision: str, files: list[str] | tuple[str, ...], entrypoint: str) -> str:
    """The identity of one exact set of model files: SHA-256 of a canonical JSON object.

    The object is `{"entrypoint": …, "files": [sorted names], "repo_id": …, "revision": …}` serialised with
    sorted keys, no whitespace and UTF-8 (`json.dumps(sort_keys=True, separators=(",", ":"),
    ensure_ascii=False)`), so the same repository, commit and files give the same id on every host.

    Args:
        repo_id: `ORG/NAME`.
        revision: the resolved commit (40 hex), never a branch or tag.
        files: the file names relative to the snapshot (`sub/x.gguf`), in any order.
        entrypoint: the file an engine loads (a standalone GGUF, or shard 1 of a split family).

    Returns:
        64 lower-case hex characters.
    """
    canonical = json.dumps(
        {"entrypoint": entrypoint, "files": sorted(files), "repo_id": repo_id, "revision": revision},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class IssueKind(StrEnum):
    """Why an entry of the cache is reported but not offered (or offered with a warning)."""

    INCOMPLETE = "incomplete"
    """Files are missing: a split family without all its shards, a safetensors model without a shard it lists, a
    snapshot link whose blob is gone (the issue names the file; the rest of the snapshot is offered)."""
    UNVERIFIABLE = "unverifiable"
    """The bytes cannot be checked: the snapshot holds a copy, not a link to a blob named by its SHA-256. Offered,
    flagged."""
    INVALID = "invalid"
    """Present but unusable, as a launch would refuse it (`inspect_model`): not a GGUF, cut short, missing a key
    llama-server needs, out of bounds, an architecture llama.cpp does not load, or a tensor it needs missing."""
    CORRUPTED = "corrupted"
    """huggingface_hub could not read the repository's cache layout (a broken link, a ref to a missing commit);
    the scan is degraded."""


@dataclass(frozen=True, slots=True)
class CatalogIssue:
    """One entry the catalog reports instead of (or besides) offering it."""

    kind: IssueKind
    repo_id: str
    """`ORG/NAME`, or the repository folder's name when the layout could not be read."""
    revision: str | None
    """The commit, when known."""
    files: tuple[str, ...]
    """The files concerned (the shards present, the unreadable file)."""
    reason: str
    """One sentence naming what is wrong."""

    def view(self) -> dict[str, Any]:
        """As JSON for the API."""
        return {
            "kind": self.kind.value,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "files": list(self.files),
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class GgufGeneration:
    """One GGUF generation: a standalone `.gguf`, or a complete split family with shard 1 as its entrypoint."""

    artifact_id: str
    repo_id: str
    revision: str
    """The commit the snapshot belongs to."""
    refs: tuple[str, ...]
    """Branches and tags pointing at the commit (`main`)."""
    entrypoint: str
    """The file llama-server loads, relative to the snapshot."""
    files: tuple[str, ...]
    """Every file of the generation, sorted."""
    entrypoint_path: Path
    """The entrypoint in the snapshot (a link into `blobs/`)."""
    size_bytes: int
    architecture: str
    """`general.architecture`."""
    quantization: str | None
    """From `general.file_type` (`Q4_K_M`, `F16`), else None."""
    context_length: int
    """`<arch>.context_length`, the training context in tokens."""
    modelled: bool
    """Whether the sizing planner models this architecture (else `llama-fit-params` sizes it)."""
    verifiable: bool
    """Whether every file links to a blob named by its SHA-256, so `qiip model verify` can check it."""
    blobs: tuple[Path, ...] = field(default=())
    """The blob each file links to, in `files` order."""

    def view(self) -> dict[str, Any]:
        """As JSON for the API."""
        return {
            "artifact_id": self.artifact_id,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "refs": list(self.refs),
            "entrypoint": self.entrypoint,
            "files": list(self.files),
            "path": str(self.entrypoint_path),
            "size_bytes": self.size_bytes,
            "architecture": self.architecture,
            "quantization": self.quantization,
            "context_length": self.context_length,
            "modelled": self.modelled,
            "verifiable": self.verifiable,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class FullModel:
    """A complete safetensors snapshot (what vLLM serves)."""

    artifact_id: str
    repo_id: str
    revision: str
    refs: tuple[str, ...]
    entrypoint: str
    """`model.safetensors.index.json`, or the single `model.safetensors`."""
    files: tuple[str, ...]
    snapshot_path: Path
    size_bytes: int

    def view(self) -> dict[str, Any]:
        """As JSON for the API."""
        return {
            "artifact_id": self.artifact_id,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "refs": list(self.refs),
            "entrypoint": self.entrypoint,
            "files": list(self.files),
            "path": str(self.snapshot_path),
            "size_bytes": self.size_bytes,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Catalog:
    """One scan of the Hugging Face cache."""

    cache_dir: Path
    gguf: tuple[GgufGeneration, ...]
    """GGUF generations offered, by repository then entrypoint."""
    full: tuple[FullModel, ...]
    """Complete safetensors models offered."""
    issues: tuple[CatalogIssue, ...]
    """Entries reported: incomplete, unverifiable, invalid, corrupted."""
    repos: int
    """Model repositories the scan read."""
    files: int
    """Files in their snapshots."""
    exists: bool = True
    """False when the cache directory does not exist yet (an empty catalog, not a degraded one)."""

    @property
    def counters(self) -> dict[str, int]:
        """Issues by kind: `{"incomplete": n, "unverifiable": n, "invalid": n, "corrupted": n}`."""
        counts = {kind.value: 0 for kind in IssueKind}
        for issue in self.issues:
            counts[issue.kind.value] += 1
        return counts

    @property
    def degraded(self) -> bool:
        """Whether part of the cache could not be read (a corrupted repository): the lists may be short."""
        return any(issue.kind is IssueKind.CORRUPTED for issue in self.issues)

    def generation(self, artifact: str) -> GgufGeneration | None:
        """The GGUF generation with this `artifact_id`, or None."""
        return next((g for g in self.gguf if g.artifact_id == artifact), None)

    def view(self) -> dict[str, Any]:
        """As JSON for `GET /admin/models/catalog`."""
        return {
            "cache_dir": str(self.cache_dir),
            "exists": self.exists,
            "degraded": self.degraded,
            "counters": self.counters,
            "repos": self.repos,
            "files": self.files,
            "gguf": [g.view() for g in self.gguf],
            "full": [m.view() for m in self.full],
            "issues": [i.view() for i in self.issues],
        }
