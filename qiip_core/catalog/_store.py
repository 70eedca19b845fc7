"""The model store: registered manifests, their acquisition, and published revisions.

```
<store_dir>/manifests/<rev_id>.json        the registered manifest (immutable)
<store_dir>/paused/<rev_id>                present while a pause is asked for (the CLI and the daemon both see it)
<store_dir>/objects/sha256/<digest>        verified objects, shared by every revision that lists them
<store_dir>/revisions/<rev_id>/<name>  ->  ../../objects/sha256/<digest>   a published, flat snapshot
```

A revision is published (its snapshot directory renamed into place) only once every file is verified, so a node
never sees a partial one. Registration never replaces: the same manifest again is the same revision, and another
manifest for the same source and revision is refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import ssl
import tempfile
import threading
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qiip_core._errors import (
    AcquisitionPaused,
    ArtifactNotFound,
    ModelStoreError,
    QiipError,
    RevisionInUse,
    RevisionNotFound,
)
from qiip_core.catalog._acquire import ObjectStore, Transfer
from qiip_core.catalog._manifest import Manifest, parse_manifest
from qiip_core.catalog._scan import resolve_artifact
from qiip_core.storage import atomic_write

if TYPE_CHECKING:
    from qiip_core.config import Settings

__all__ = ["AcquisitionState", "ModelStore", "RevisionStatus", "artifact_entrypoint", "model_store_for"]

logger = logging.getLogger("qiip.catalog")


class AcquisitionState(StrEnum):
    """Where a registered revision's files are."""

    REGISTERED = "registered"
    """Nothing acquired yet."""
    PARTIAL = "partial"
    """Some bytes or files are durable; acquire to resume."""
    ACQUIRING = "acquiring"
    """An acquisition runs in this process."""
    PAUSED = "paused"
    """A pause was asked for; acquire to resume."""
    AVAILABLE = "available"
    """Every file verified and the revision published."""
    FAILED = "failed"
    """The last acquisition failed (`error`)."""


@dataclass(slots=True)
class RevisionStatus:
    """A registered revision and how far its acquisition got."""

    manifest: Manifest
    state: AcquisitionState
    bytes_done: int
    error: str | None = None
    path: Path | None = None
    """The published entrypoint, once available."""

    def view(self) -> dict[str, Any]:
        """As JSON for the API."""
        m = self.manifest
        return {
            "id": m.id,
            "artifact_id": m.artifact_id,
            "name": m.name,
            "source": m.source,
            "revision": m.revision,
            "licence": m.licence,
            "format": m.format,
            "quantization": m.quantization,
            "entrypoint": m.entrypoint,
            "capabilities": list(m.capabilities),
            "files": [f.model_dump(mode="json") for f in m.files],
            "state": self.state.value,
            "bytes_done": self.bytes_done,
            "bytes_total": m.size_bytes,
            "error": self.error,
            "path": str(self.path) if self.path else None,
        }


class ModelStore:
    """Registers manifests and acquires their files. Methods block (disk, network): call them from a thread.

    Args:
        root: `models.store_dir`.
        allowed_hosts: `models.allowed_download_hosts`.
        chunk_bytes: `models.chunk_bytes`.
        ca_bundle: `models.ca_bundle`, or None for the system's authorities.
    """

    def __init__(
        self,
        root: Path,
        *,
        allowed_hosts: list[str],
        chunk_bytes: int = 16 * 1024 * 1024,
        ca_bundle: Path | None = None,
    ) -> None:
        self.root = root
        self.allowed_hosts = allowed_hosts
        self.objects = ObjectStore(root, chunk_bytes=chunk_bytes)
        self.verify_tls: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_bundle) if ca_bundle else True
        self._lock = threading.Lock()
        self._active: dict[str, Transfer] = {}
        self._errors: dict[str, str] = {}

    def register(self, data: Any) -> tuple[Manifest, bool]:
        """Register a manifest (parsed JSON).

        Returns:
            The manifest and whether it is new (False when the same manifest was registered before).

        Raises:
            ManifestInvalid: the manifest breaks a rule.
            RevisionInUse: another manifest is registered for the same source and revision.
        """
        manifest = parse_manifest(data, allowed_hosts=self.allowed_hosts)
        with self._lock:
            path = self._manifest_path(manifest.id)
            if path.exists():
                return manifest, False
            for other in self.manifests():
                if (other.source, other.revision) == (manifest.source, manifest.revision):
                    raise RevisionInUse(
                        f"{manifest.source} revision {manifest.revision} is registered already as {other.id} with "
                        "other contents; a registered revision is never replaced. Register the new files under their "
                        "own revision."
                    )
            atomic_write(path, manifest.model_dump_json(indent=2).encode(), mode=0o644)
        logger.info("registered %s (%s@%s)", manifest.id, manifest.source, manifest.revision)
        return manifest, True

    def _manifest_path(self, revision_id: str) -> Path:
        return self.root / "manifests" / f"{revision_id}.json"

    def manifests(self) -> list[Manifest]:
        """Every registered manifest, by id."""
        directory = self.root / "manifests"
        if not directory.is_dir():
            return []
        return [Manifest.model_validate_json(p.read_bytes()) for p in sorted(directory.glob("rev_*.json"))]

    def get(self, revision_id: str) -> Manifest:
        """A registered manifest.

        Raises:
            RevisionNotFound: none has this id.
        """
        path = self._manifest_path(revision_id)
        if not revision_id.startswith("rev_") or "/" in revision_id or not path.is_file():
            raise RevisionNotFound(
                f"No registered model revision has id {revision_id!r}; `qiip model status` lists them."
            )
        return Manifest.model_validate_json(path.read_bytes())

    def _published(self, manifest: Manifest) -> Path:
        return self.root / "revisions" / manifest.id

    def status(self, revision_id: str) -> RevisionStatus:
        """The revision and its acquisition state, from what is on disk and what runs here."""
        manifest = self.get(revision_id)
        published = self._published(manifest)
        transfer = self._active.get(manifest.id)
        done = sum(f.bytes if self.objects.has(f) else self.objects.durable_offset(f.sha256) for f in manifest.files)
        if transfer is not None:
            done = sum(f.bytes for f in manifest.files if self.objects.has(f)) + transfer.bytes_done
        if published.is_dir():
            state = AcquisitionState.AVAILABLE
        elif transfer is not None:
            state = AcquisitionState.ACQUIRING
        elif self._pause_marker(manifest.id).exists():
            state = AcquisitionState.PAUSED
        elif manifest.id in self._errors:
            state = AcquisitionState.FAILED
        else:
            state = AcquisitionState.PARTIAL if done else AcquisitionState.REGISTERED
        path = published / manifest.entrypoint if state is AcquisitionState.AVAILABLE else None
        return RevisionStatus(manifest, state, min(done, manifest.size_bytes), self._errors.get(manifest.id), path)

    def _pause_marker(self, revision_id: str) -> Path:
        return self.root / "paused" / revision_id

    def pause(self, revision_id: str) -> RevisionStatus:
        """Ask the running acquisition of `revision_id` (in any process on this store) to stop at its next chunk."""
        self.get(revision_id)
        marker = self._pause_marker(revision_id)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        return self.status(revision_id)

    def acquire(self, revision_id: str, *, local_dir: Path | None = None) -> RevisionStatus:
        """Acquire every file of a revision (resuming partial ones), verify each, and publish the revision.

        Args:
            revision_id: a registered revision.
            local_dir: upload the files from this directory (by their names) instead of fetching their URLs.

        Returns:
            Its status (`available`).

        Raises:
            RevisionNotFound: no such revision.
            RevisionInUse: an acquisition of it already runs in this process.
            AcquisitionPaused: paused; the offsets are durable.
            SourceNotAllowed, ObjectMismatch, DownloadFailed: as `ObjectStore.acquire` (nothing is published).
            ModelStoreError: the store's directory cannot be written.
        """
        manifest = self.get(revision_id)
        with self._lock:
            if manifest.id in self._active:
                raise RevisionInUse(f"Revision {manifest.id} is being acquired already.")
            marker = self._pause_marker(manifest.id)
            with contextlib.suppress(FileNotFoundError):
                marker.unlink()
            transfer = Transfer(should_pause=marker.exists)
            self._active[manifest.id] = transfer
            self._errors.pop(manifest.id, None)
        try:
            if not self._published(manifest).is_dir():
                for file in manifest.files:
                    transfer.check()
                    local = local_dir / file.name if local_dir is not None else None
                    self.objects.acquire(
                        file,
                        allowed_hosts=self.allowed_hosts,
                        transfer=transfer,
                        verify=self.verify_tls,
                        local=local,
                    )
                    transfer.bytes_done = 0
                self._publish(manifest)
        except AcquisitionPaused:
            raise
        except QiipError as exc:
            self._errors[manifest.id] = exc.message
            raise
        except OSError as exc:
            error = ModelStoreError(f"The model store {self.root} cannot be written: {exc}.")
            self._errors[manifest.id] = error.message
            raise error from exc
        finally:
            with self._lock:
                self._active.pop(manifest.id, None)
        return self.status(manifest.id)

    def _publish(self, manifest: Manifest) -> None:
        """Link every verified object under its name in a temporary directory, then rename it into place."""
        target = self._published(manifest)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{manifest.id}.", dir=target.parent))
        try:
            for file in manifest.files:
                os.symlink(Path("../../objects/sha256") / file.sha256, tmp / file.name)
            (tmp / ".manifest.json").write_text(json.dumps(manifest.model_dump(mode="json"), indent=2))
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("revision %s is available at %s", manifest.id, target)

    def verify(self, revision_id: str) -> dict[str, bool]:
        """Hash every published object of a revision again: `{file name: matches}`."""
        manifest = self.get(revision_id)
        return {f.name: self.objects.verify(f) for f in manifest.files}

    def resolve(self, artifact: str) -> Path | None:
        """The published entrypoint of the revision whose `artifact_id` is `artifact`, or None."""
        for manifest in self.manifests():
            if manifest.artifact_id == artifact and self._published(manifest).is_dir():
                return self._published(manifest) / manifest.entrypoint
        return None


def model_store_for(settings: Settings) -> ModelStore:
    """The store `settings` describe (`models.store_dir`, else `<state_dir>/models/store`)."""
    models = settings.models
    return ModelStore(
        models.store_dir or settings.state_dir / "models" / "store",
        allowed_hosts=models.allowed_download_hosts,
        chunk_bytes=models.chunk_bytes,
        ca_bundle=models.ca_bundle,
    )


def artifact_entrypoint(settings: Settings, artifact: str) -> Path:
    """The GGUF a node serves for `artifact`: an acquired manifest revision, else a generation of the Hugging Face
    cache (`models.hf_cache_dir`). What `qiip up --artifact`, `[[local_nodes]] artifact_id` and a relaunch to
    another artifact all resolve. Blocking (a cache scan): run it in a thread from async code.

    Args:
        settings: the settings naming the model store and the hub cache.
        artifact: an `artifact_id` (64 lower-case hexadecimal characters).

    Returns:
        The entrypoint's path (the first shard of a split family).

    Raises:
        ArtifactNotFound: neither has a complete copy; a revision registered with this id but not acquired yet is
            named, with its acquisition state.
    """
    store = model_store_for(settings)
    acquired = store.resolve(artifact)
    if acquired is not None:
        return acquired
    try:
        return resolve_artifact(artifact, settings.models.hf_cache_dir)
    except ArtifactNotFound as exc:
        pending = next((m for m in store.manifests() if m.artifact_id == artifact), None)
        if pending is None:
            raise
        state = store.status(pending.id).state.value
        raise ArtifactNotFound(
            artifact,
            settings.models.hf_cache_dir or "",
            message=f"Artifact {artifact} is revision {pending.id}, which is {state}, not acquired; "
            f"`qiip model acquire {pending.id}` completes it.",
        ) from exc
