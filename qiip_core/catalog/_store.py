"""The model store: registered manifests, their acquisition, and published revisions.

```
<store_dir>/manifests/<rev_id>.json        the registered manifest (immutable)
<store_dir>/paused/<rev_id>                present while a pause is asked for (the CLI and the daemon both see it)
<store_dir>/acquisitions/<rev_id>.json     the last acquisition: acquiring (by whom), paused or failed (and why)
<store_dir>/locks/revisions/<rev_id>.lock  flock: held by the process acquiring the revision
<store_dir>/objects/sha256/<digest>        verified objects, shared by every revision that lists them
<store_dir>/revisions/<rev_id>/<name>  ->  ../../objects/sha256/<digest>   a published, flat snapshot
```

A revision is published (its snapshot directory renamed into place) only once every file is verified, so a node
never sees a partial one. Registration never replaces: the same manifest again is the same revision, and another
manifest for the same source and revision is refused.

What an acquisition does is in the store, not in the memory of the process running it: every process on the store
(the daemon, `qiip model status`, a daemon started again) reads the same state. An acquisition's record says who
runs it; the revision's lock says whether that process still does (the kernel drops it with the process), so an
acquisition killed part-way reads as interrupted, with the bytes it made durable, never as running. Two acquisitions
of one revision, in two processes, are one after the other: the second waits for the first's lock, then finds its
objects published.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import ssl
import tempfile
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
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
from qiip_core.catalog._files import exclusive_lock, lock_held
from qiip_core.catalog._manifest import Manifest, parse_manifest
from qiip_core.catalog._scan import default_cache_dir, resolve_artifact, scan_catalog
from qiip_core.catalog._types import match_artifact_id
from qiip_core.storage import atomic_write

if TYPE_CHECKING:
    from qiip_core.config import Settings

__all__ = [
    "AcquisitionState",
    "ModelStore",
    "RevisionStatus",
    "artifact_entrypoint",
    "model_store_for",
    "resolve_artifact_id",
]

logger = logging.getLogger("qiip.catalog")


class AcquisitionState(StrEnum):
    """Where a registered revision's files are."""

    REGISTERED = "registered"
    """Nothing acquired yet."""
    PARTIAL = "partial"
    """Some bytes or files are durable; acquire to resume. `error` says so when an acquisition was interrupted."""
    ACQUIRING = "acquiring"
    """An acquisition runs, in this process or another one on the store."""
    PAUSED = "paused"
    """A pause was asked for; acquire to resume."""
    UNPUBLISHED = "unpublished"
    """Every file is verified in the store, but the revision is not published yet (an acquisition stopped before its
    last step, or the files came with another revision); acquire publishes it without a transfer."""
    UNVERIFIED = "unverified"
    """Every file is present, but not every one has been verified as it is on disk now (a store written by an
    older version, or a file changed since); acquire or verify hashes it, and quarantines it if it does not match."""
    AVAILABLE = "available"
    """Every file verified and the revision published."""
    FAILED = "failed"
    """The last acquisition failed, or a published file failed verification and was quarantined (`error`)."""


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
        if not re.fullmatch(r"rev_[0-9a-f]{1,64}", revision_id) or not path.is_file():
            raise RevisionNotFound(
                f"No registered model revision has id {revision_id[:80]!r}; `qiip model status` lists them."
            )
        return Manifest.model_validate_json(path.read_bytes())

    def _published(self, manifest: Manifest) -> Path:
        return self.root / "revisions" / manifest.id

    def _revision_lock(self, revision_id: str) -> Path:
        return self.root / "locks" / "revisions" / f"{revision_id}.lock"

    def _record_path(self, revision_id: str) -> Path:
        return self.root / "acquisitions" / f"{revision_id}.json"

    def _read_record(self, revision_id: str) -> dict[str, Any]:
        try:
            record = json.loads(self._record_path(revision_id).read_bytes())
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def _write_record(self, revision_id: str, state: str, error: str | None = None) -> None:
        record = {
            "state": state,
            "error": error,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        atomic_write(self._record_path(revision_id), json.dumps(record).encode(), mode=0o644)

    def status(self, revision_id: str) -> RevisionStatus:
        """The revision and its acquisition state, from what is on disk, the store's records and its locks (so the
        same from every process). Cheap: it reads records and stats files, never hashes them."""
        manifest = self.get(revision_id)
        published = self._published(manifest)
        transfer = self._active.get(manifest.id)
        verified = [self.objects.has(f) for f in manifest.files]
        present = [ok or self.objects.present(f) for ok, f in zip(verified, manifest.files, strict=True)]
        done = sum(
            f.bytes if ok else self.objects.durable_offset(f.sha256)
            for ok, f in zip(present, manifest.files, strict=True)
        )
        if transfer is not None:
            done = sum(f.bytes for ok, f in zip(verified, manifest.files, strict=True) if ok) + transfer.bytes_done
        record = self._read_record(manifest.id)
        running = transfer is not None or lock_held(self._revision_lock(manifest.id))
        error: str | None = None
        quarantined = [
            (f, note)
            for ok, f in zip(present, manifest.files, strict=True)
            if not ok and (note := self.objects.quarantined(f.sha256)) is not None
        ]
        if all(verified) and published.is_dir():
            state = AcquisitionState.AVAILABLE
        elif running:
            state = AcquisitionState.ACQUIRING
        elif self._pause_marker(manifest.id).exists():
            state = AcquisitionState.PAUSED
        elif record.get("state") == "failed":
            state, error = AcquisitionState.FAILED, str(record.get("error") or "the acquisition failed")
        elif quarantined:
            file, note = quarantined[0]
            state = AcquisitionState.FAILED
            error = (
                f"{file.name} failed verification ({note.get('reason')}) and was moved to {note.get('moved_to')}; "
                f"acquire again to fetch it."
            )
        elif all(verified):
            state = AcquisitionState.UNPUBLISHED
        elif all(present):
            state = AcquisitionState.UNVERIFIED
        else:
            state = AcquisitionState.PARTIAL if done else AcquisitionState.REGISTERED
            if record.get("state") == "acquiring":
                error = (
                    f"The acquisition by process {record.get('pid')} on {record.get('host')} stopped at "
                    f"{done:,} bytes without finishing (it was stopped or killed); acquire again to resume."
                )
        path = published / manifest.entrypoint if state is AcquisitionState.AVAILABLE else None
        return RevisionStatus(manifest, state, min(done, manifest.size_bytes), error, path)

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

        An acquisition of the same revision in another process, or of a file it shares with another revision, is
        waited for (a pause still stops the wait); what it published is then used, never written again.

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
        try:
            with exclusive_lock(self._revision_lock(manifest.id), check=transfer.check):
                self._write_record(manifest.id, "acquiring")
                for file in manifest.files:
                    transfer.check()
                    local = local_dir / file.name if local_dir is not None else None
                    if not self.objects.trusted(file, check=transfer.check):
                        self.objects.acquire(
                            file,
                            allowed_hosts=self.allowed_hosts,
                            transfer=transfer,
                            verify=self.verify_tls,
                            local=local,
                        )
                    transfer.bytes_done = 0
                if not self._published(manifest).is_dir():
                    self._publish(manifest)
                with contextlib.suppress(FileNotFoundError):
                    self._record_path(manifest.id).unlink()
        except AcquisitionPaused:
            self._record_failure(manifest.id, "paused", None)
            raise
        except QiipError as exc:
            self._record_failure(manifest.id, "failed", exc.message)
            raise
        except OSError as exc:
            error = ModelStoreError(f"The model store {self.root} cannot be written: {exc}.")
            self._record_failure(manifest.id, "failed", error.message)
            raise error from exc
        finally:
            with self._lock:
                self._active.pop(manifest.id, None)
        return self.status(manifest.id)

    def _record_failure(self, revision_id: str, state: str, error: str | None) -> None:
        try:
            self._write_record(revision_id, state, error)
        except OSError as exc:  # the store cannot be written: the error raised says so already
            logger.warning("the acquisition record of %s cannot be written: %s", revision_id, exc)

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
        """Hash every published object of a revision again: `{file name: matches}`. An object that does not match is
        quarantined (never served; the next acquisition fetches it again)."""
        manifest = self.get(revision_id)
        return {f.name: self.objects.verify(f) for f in manifest.files}

    def resolve(self, artifact: str) -> Path | None:
        """The published entrypoint of the revision whose `artifact_id` is `artifact`, or None.

        Every file must be verified as it is on disk (`ObjectStore.trusted`: an object without a current record is
        hashed first, and quarantined if it does not match), so a damaged object is never served.
        """
        for manifest in self.manifests():
            if manifest.artifact_id == artifact and self._published(manifest).is_dir():
                if all(self.objects.trusted(f) for f in manifest.files):
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


def resolve_artifact_id(settings: Settings, given: str) -> str:
    """The whole `artifact_id` an operator means: `given` itself (64 hex), or the one id it is a prefix of (at least
    8 hex) among the registered manifest revisions and the Hugging Face cache's generations and full models. What
    every command and route that takes an artifact id calls first. Blocking (a cache scan for a prefix): run it in a
    thread from async code.

    Args:
        settings: the settings naming the model store and the hub cache.
        given: the id or its prefix.

    Returns:
        The whole id (whether it can be served is `artifact_entrypoint`'s to say).

    Raises:
        ArtifactIdInvalid: `given` is not 8 to 64 lower-case hexadecimal characters.
        ArtifactAmbiguous: `given` is the start of several ids; the message lists them.
        ArtifactNotFound: no known id starts with `given`.
    """
    if len(given) == 64:
        match_artifact_id(given, ())  # the form only: a whole id is checked where it is used
        return given
    store = model_store_for(settings)
    root = settings.models.hf_cache_dir or default_cache_dir()
    known = {m.artifact_id for m in store.manifests()}
    try:
        catalog = scan_catalog(root)
    except OSError:
        catalog = None
    if catalog is not None:
        known |= {g.artifact_id for g in catalog.gguf} | {m.artifact_id for m in catalog.full}
    found = match_artifact_id(given, known)
    if found is None:
        raise ArtifactNotFound(
            given,
            root,
            message=f"No artifact id starts with {given}: neither a registered revision nor the Hugging Face cache "
            f"{root} has one; `qiip model list` and `qiip model status` show them.",
        )
    return found


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
        status = store.status(pending.id)
        why = f" ({status.error.rstrip('.')})" if status.error else ""
        raise ArtifactNotFound(
            artifact,
            settings.models.hf_cache_dir or "",
            message=f"Artifact {artifact} is revision {pending.id}, which is {status.state.value}{why}, not "
            f"available; `qiip model acquire {pending.id}` completes it.",
        ) from exc
