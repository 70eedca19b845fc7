"""Downloads from the Hugging Face hub into the cache, as tracked background operations.

A download resolves its revision (a branch, tag or commit) to the commit SHA with the hub's metadata route
(`GET /api/models/{repo_id}/revision/{revision}`, `HfApi.model_info`), then fetches each file with
`hf_hub_download` pinned to that commit: huggingface_hub's own machinery (`HEAD …/resolve/{commit}/{file}` for the
`X-Repo-Commit`, `X-Linked-Etag` and `X-Linked-Size` headers, the redirect to the storage host, a broken transfer
retried with `Range` from its last whole chunk, the blob named by its ETag and the snapshot link). Finally the
requested branch or tag is pointed at the commit in `refs/`, as huggingface_hub does when it resolves one itself.

Requests are duplicate-safe: one for the same repository, revision and files while a download of them runs joins
it (the same id); once it has finished (or failed) the same request starts a new one. Progress (bytes done and
total, rate, ETA) is counted from huggingface_hub's progress callback, which this module supplies.

Nothing the client or the hub says becomes a path unchecked: a revision is a branch or tag name (git's rules for a
ref name: no `..`, no component starting with `.`, no empty component) or a 40-hex commit; the commit the hub names
must be 40 hex; every file name, asked for or listed by the hub, must be a relative path inside the snapshot; and
the ref written last must land inside the repository's `refs/`.

A transfer stopped part-way leaves huggingface_hub's temporary blob (`blobs/<etag>.<id>.incomplete`) behind only when
its process was killed; such a blob is removed by the next download of the repository, once no download holds
the blob's lock (huggingface_hub's `.locks/`), and the download reports what it removed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from qiip_core._errors import DownloadFailed, QiipError
from qiip_core.nodes import hub_client_factory

if TYPE_CHECKING:
    from qiip_core.config import ModelSettings

__all__ = [
    "Download",
    "DownloadManager",
    "DownloadState",
    "check_file_name",
    "check_revision",
    "discard_partial",
    "download_files",
    "sweep_incomplete",
]

logger = logging.getLogger("qiip.catalog")

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_REF_RE = re.compile(r"^[A-Za-z0-9._/-]{1,255}$")
_MAX_FILE_NAME = 1024


def check_revision(revision: str) -> str:
    """Refuse a revision that is not a branch or tag name or a commit, before it becomes a path (`refs/<revision>`).

    A ref name follows git's rules (`git check-ref-format`), restricted to the characters the hub uses: letters,
    digits, `.`, `_`, `-` and `/`; no empty component (a leading, trailing or doubled `/`), no component starting
    with `.` (so no `..`) or ending with `.lock`, and no trailing `.`. A commit is 40 lower-case hex characters.

    Args:
        revision: what the client asked for.

    Returns:
        The revision, unchanged.

    Raises:
        ValueError: the revision breaks a rule; the message names it.
    """
    if _COMMIT_RE.match(revision):
        return revision
    shown = revision[:80]
    if not _REF_RE.match(revision):
        raise ValueError(
            f"revision {shown!r} is not a branch, tag or commit: use 1 to 255 letters, digits, '.', '_', '-' and '/'."
        )
    parts = revision.split("/")
    if any(part == "" for part in parts):
        raise ValueError(f"revision {shown!r} has an empty path component (a leading, trailing or doubled '/').")
    if any(part.startswith(".") or part.endswith(".lock") for part in parts) or revision.endswith("."):
        raise ValueError(
            f"revision {shown!r} is not a valid ref name: a component starts with '.' (such as '..') or ends with "
            "'.lock', or the name ends with '.'."
        )
    return revision


def check_file_name(name: str) -> str:
    """Refuse a repository file name that would not stay inside its snapshot (asked for, or listed by the hub).

    Args:
        name: a file's path in the repository (`sub/model.gguf`).

    Returns:
        The name, unchanged.

    Raises:
        ValueError: empty or too long, absolute, with a backslash or a control character, or with an empty, `.` or
            `..` component.
    """
    shown = name[:80]
    if not name or len(name) > _MAX_FILE_NAME or name.startswith("/"):
        raise ValueError(f"file name {shown!r} is not a relative path of 1 to {_MAX_FILE_NAME} characters.")
    if "\\" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValueError(f"file name {shown!r} holds a backslash or a control character.")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise ValueError(f"file name {shown!r} has an empty, '.' or '..' path component.")
    return name


class DownloadState(StrEnum):
    """Where a download is."""

    RUNNING = "running"
    """Resolving the revision or transferring files."""
    SUCCEEDED = "succeeded"
    """Every file is in the cache and the revision's ref is written."""
    FAILED = "failed"
    """Stopped; `error` says why. Files already complete stay in the cache and are not fetched again."""


class _Cancelled(Exception):
    """Raised from the progress callback to stop a transfer (the daemon is stopping)."""


@dataclass(slots=True, kw_only=True)
class Download:
    """One download: what was asked, what was resolved, and how far it got.

    Attributes:
        id: `dl_` + 16 hex.
        repo_id: `ORG/NAME`.
        revision: the branch, tag or commit asked for (`main` by default).
        files: the files asked for; empty for every file of the revision.
        commit: the resolved commit SHA, once known.
        resolved_files: the files being fetched, once known.
        bytes_done, bytes_total: progress in bytes (`bytes_total` is None until the sizes are known).
        current_file: the file in transfer.
        removed_incomplete: leftovers of killed downloads it removed (`name (N bytes)`).
    """

    id: str
    repo_id: str
    revision: str
    files: tuple[str, ...]
    state: DownloadState = DownloadState.RUNNING
    commit: str | None = None
    resolved_files: tuple[str, ...] = ()
    bytes_done: int = 0
    bytes_total: int | None = None
    current_file: str | None = None
    current_etag: str | None = None
    """The blob name (its ETag: SHA-256 for an LFS file, the git blob id else) of the file in transfer."""
    removed_incomplete: tuple[str, ...] = ()
    """Temporary blobs of earlier, killed downloads of the repository that this one removed."""
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    finished_at: datetime | None = None
    error: str | None = None
    _started_mono: float = field(default_factory=time.monotonic)
    _finished_mono: float = 0.0
    _transferred: int = 0
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop the transfer at its next chunk (huggingface_hub then removes its temporary blob)."""
        self._cancel.set()

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """What makes two requests the same: repository, revision and the sorted files."""
        return (self.repo_id, self.revision, self.files)

    @property
    def rate_bytes_per_s(self) -> float:
        """Bytes transferred per second since the download started (files already cached do not count)."""
        elapsed = (time.monotonic() if self.finished_at is None else self._finished_mono) - self._started_mono
        return self._transferred / elapsed if elapsed > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the current rate; None when unknown, 0 when finished."""
        if self.state is not DownloadState.RUNNING:
            return 0.0
        rate = self.rate_bytes_per_s
        if self.bytes_total is None or rate <= 0:
            return None
        return max(self.bytes_total - self.bytes_done, 0) / rate

    def view(self) -> dict[str, Any]:
        """As JSON for `GET /admin/models/downloads`."""
        return {
            "id": self.id,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "files": list(self.files),
            "state": self.state.value,
            "commit": self.commit,
            "resolved_files": list(self.resolved_files),
            "current_file": self.current_file,
            "removed_incomplete": list(self.removed_incomplete),
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "rate_bytes_per_s": round(self.rate_bytes_per_s, 1),
            "eta_s": None if self.eta_s is None else round(self.eta_s, 1),
            "started_at": self.started_at.isoformat(),
            "finished_at": self.finished_at.isoformat() if self.finished_at else None,
            "error": self.error,
        }


class _Progress:
    """The progress bar huggingface_hub opens per file transfer (its `tqdm_class`): counts into a `Download`.

    huggingface_hub calls a `tqdm_class` that is not its own tqdm with the bar's keyword arguments only
    (`total`, `initial`, `desc`, `unit`, `unit_scale`), then `update(n)` per chunk (negative when the server ignored
    `Range` and the transfer restarts), inside a `with` block.
    """

    def __init__(self, download: Download, base: int, **kwargs: Any) -> None:
        self.download = download
        self.base = base
        self.n = int(kwargs.get("initial") or 0)
        download.bytes_done = base + self.n

    def update(self, n: int | float = 1) -> None:
        if self.download._cancel.is_set():
            raise _Cancelled()
        self.n += int(n)
        if n > 0:
            self.download._transferred += int(n)
        self.download.bytes_done = self.base + self.n

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def close(self) -> None:
        """Nothing to release."""


_HUB_CLIENT_SET = threading.Lock()
_hub_client_set = False


def _check_hub_connections() -> None:
    """Make huggingface_hub's client hold every connection to the address rule (once per process: replacing the
    factory closes the shared client, which another download may be using), and keep every transfer on it.

    A file the hub stores with Xet would otherwise go to `hf_xet`, a native client with its own resolver and
    sockets, to a CAS server the hub's answer names: connections no Python check sees. With Xet off, huggingface_hub
    fetches the same file over its HTTP client (`HF_HUB_DISABLE_XET`, read at each download).
    """
    global _hub_client_set
    with _HUB_CLIENT_SET:
        if not _hub_client_set:
            from huggingface_hub import constants, set_client_factory

            constants.HF_HUB_DISABLE_XET = True
            set_client_factory(hub_client_factory())
            _hub_client_set = True


def download_files(download: Download, *, settings: ModelSettings, cache_dir: Path) -> None:
    """Run `download` to its end in this thread: resolve, fetch each file, write the ref.

    Args:
        download: the record to fill in (commit, files, progress).
        settings: `[models]` (the hub endpoint and token).
        cache_dir: the hub cache to fill.

    Raises:
        DownloadFailed: the repository, revision or a file does not exist or is not accessible, the hub cannot be
            reached, or a transfer broke past huggingface_hub's retries (complete files stay in the cache).
    """
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    _check_hub_connections()
    endpoint = settings.hub_endpoint
    token: str | bool = settings.hub_token.get_secret_value() if settings.hub_token else False
    what = f"{download.repo_id}@{download.revision[:80]}"
    try:
        check_revision(download.revision)
        for name in download.files:
            check_file_name(name)
    except ValueError as exc:
        raise DownloadFailed(f"The download of {download.repo_id} is refused: {exc}") from None
    download.removed_incomplete = tuple(sweep_incomplete(cache_dir, download.repo_id))
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(
            download.repo_id, revision=download.revision, files_metadata=True
        )
        if not info.sha or not _COMMIT_RE.match(info.sha):
            raise DownloadFailed(
                f"The hub named the commit of {what} {str(info.sha)[:80]!r}, not 40 hexadecimal characters; it is "
                "not a Hugging Face hub."
            )
        download.commit = info.sha
        sizes = {s.rfilename: s.size for s in info.siblings or []}
        etags = {s.rfilename: s.lfs.sha256 if s.lfs else s.blob_id for s in info.siblings or []}
        for name in sizes:
            try:
                check_file_name(name)
            except ValueError as exc:
                raise DownloadFailed(f"The hub listed a file of {what} that cannot be stored: {exc}") from None
        files = download.files or tuple(sorted(sizes))
        unknown = [f for f in files if f not in sizes]
        if unknown:
            raise DownloadFailed(
                f"{download.repo_id} at {info.sha[:12]} has no file {', '.join(unknown)}; "
                "the hub lists the files it has on the repository page."
            )
        download.resolved_files = files
        known = [sizes[f] for f in files]
        download.bytes_total = sum(s for s in known if s is not None) if all(s is not None for s in known) else None
        done = 0
        for name in files:
            download.current_file, download.current_etag = name, etags.get(name)

            def progress(*args: Any, base: int = done, **kwargs: Any) -> _Progress:
                return _Progress(download, base, **kwargs)

            path = hf_hub_download(
                download.repo_id,
                name,
                revision=info.sha,
                cache_dir=cache_dir,
                endpoint=endpoint,
                token=token,
                tqdm_class=cast(Any, progress),
            )
            done += sizes[name] or os.path.getsize(path)
            download.bytes_done = done
        download.current_file = download.current_etag = None
        if download.revision != info.sha:
            _write_ref(cache_dir, download.repo_id, download.revision, info.sha)
    except _Cancelled:
        raise DownloadFailed(
            f"The download of {what} was stopped; files already complete are kept, the next download fetches the rest."
        ) from None
    except QiipError:
        raise
    except RepositoryNotFoundError as exc:
        raise DownloadFailed(f"The hub has no repository {download.repo_id} (or it is private): {_first(exc)}") from exc
    except RevisionNotFoundError as exc:
        raise DownloadFailed(f"{download.repo_id} has no revision {download.revision!r}.") from exc
    except EntryNotFoundError as exc:
        raise DownloadFailed(f"{what}: {_first(exc)}") from exc
    except GatedRepoError as exc:
        raise DownloadFailed(f"{download.repo_id} is gated: set models.hub_token to an accepted token.") from exc
    except OfflineModeIsEnabled as exc:
        raise DownloadFailed(f"huggingface_hub is in offline mode (HF_HUB_OFFLINE); {what} cannot be fetched.") from exc
    except HfHubHTTPError as exc:
        raise DownloadFailed(f"The hub refused {what}: {_first(exc)}") from exc
    except (OSError, ValueError) as exc:
        raise DownloadFailed(f"The download of {what} failed: {exc}") from exc
    except Exception as exc:  # httpx transport errors and whatever huggingface_hub raises for a broken transfer
        raise DownloadFailed(f"The download of {what} broke: {exc.__class__.__name__}: {exc}") from exc


def _first(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__


def _write_ref(cache_dir: Path, repo_id: str, ref: str, commit: str) -> None:
    """Point `refs/<ref>` at `commit` atomically, without a trailing newline (huggingface_hub's own format).

    Raises:
        DownloadFailed: the ref would land outside the repository's `refs/` (a name `check_revision` lets through
            never does; this guards the path itself).
    """
    from huggingface_hub.file_download import repo_folder_name

    refs = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model") / "refs"
    path = refs / ref
    if not path.resolve().is_relative_to(refs.resolve()) or not _COMMIT_RE.match(commit):
        raise DownloadFailed(f"The ref {ref[:80]!r} of {repo_id} would be written outside {refs}; nothing was written.")
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own: two downloads of one repository may point the same ref at once.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    tmp.write_text(commit)
    tmp.replace(path)


def discard_partial(download: Download, cache_dir: Path) -> list[str]:
    """Remove the temporary blob of the file `download` is transferring (after `cancel`, when the transfer has not
    stopped by itself): what a process that is about to exit would otherwise leave behind.

    Returns:
        What was removed, as `name (N bytes)`.
    """
    from huggingface_hub.file_download import repo_folder_name

    etag = download.current_etag
    if not etag or not re.fullmatch(r"[0-9a-f]{40,64}", etag):
        return []
    blobs = cache_dir / repo_folder_name(repo_id=download.repo_id, repo_type="model") / "blobs"
    removed = []
    for blob in blobs.glob(f"{etag}.*.incomplete"):
        try:
            size = blob.stat().st_size
            blob.unlink()
        except OSError:
            continue
        removed.append(f"{blob.name} ({size:,} bytes)")
    return removed


def sweep_incomplete(cache_dir: Path, repo_id: str) -> list[str]:
    """Remove the temporary blobs (`blobs/*.incomplete`) that killed downloads of `repo_id` left in the cache.

    huggingface_hub writes a blob to `<etag>.<id>.incomplete` while it holds `.locks/<repo folder>/<etag>.lock`, and
    removes it when the transfer ends, well or not; one is left only when its process died. A blob whose lock can be
    taken at once is such a leftover; one whose lock is held belongs to a running download and is kept.

    Args:
        cache_dir: the hub cache.
        repo_id: `ORG/NAME`.

    Returns:
        What was removed, as `name (N bytes)`.
    """
    from filelock import FileLock, Timeout
    from huggingface_hub.file_download import repo_folder_name

    folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    removed: list[str] = []
    for blob in sorted((cache_dir / folder / "blobs").glob("*.incomplete")):
        etag = blob.name.split(".", 1)[0]
        lock = FileLock(cache_dir / ".locks" / folder / f"{etag}.lock", mode=0o664)
        try:
            lock.acquire(timeout=0)
        except (Timeout, OSError):
            continue
        try:
            size = blob.stat().st_size
            blob.unlink()
        except OSError:
            continue
        finally:
            lock.release()
        removed.append(f"{blob.name} ({size:,} bytes)")
        logger.warning("removed %s of %s (%d bytes), left by a download that was killed", blob.name, repo_id, size)
    return removed


class DownloadManager:
    """Runs downloads in the background, joins duplicates, and keeps the last `history` of them.

    Args:
        settings: `[models]`.
        cache_dir: the hub cache downloads go into.
        history: finished downloads kept for lookup.
    """

    def __init__(self, settings: ModelSettings, cache_dir: Path, *, history: int = 100) -> None:
        self.settings = settings
        self.cache_dir = cache_dir
        self._downloads: collections.OrderedDict[str, Download] = collections.OrderedDict()
        self._running: dict[tuple[str, str, tuple[str, ...]], Download] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._history = history

    def start(self, repo_id: str, *, revision: str | None = None, files: list[str] | None = None) -> Download:
        """Start a download, or join the running one for the same repository, revision and files.

        Args:
            repo_id: `ORG/NAME`.
            revision: a branch, tag or commit; `main` when None.
            files: file names in the repository; None or empty for all of them.

        Returns:
            The download (new, or the running duplicate).
        """
        download = Download(
            id="dl_" + os.urandom(8).hex(),
            repo_id=repo_id,
            revision=revision or "main",
            files=tuple(sorted(set(files or ()))),
        )
        running = self._running.get(download.key)
        if running is not None:
            return running
        self._running[download.key] = download
        self._downloads[download.id] = download
        while len(self._downloads) > self._history:
            oldest = next(iter(self._downloads.values()))
            if oldest.state is DownloadState.RUNNING:
                break
            self._downloads.popitem(last=False)
        task = asyncio.create_task(self._run(download), name=f"qiip-download-{repo_id}")
        self._tasks[download.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(download.id, None))
        return download

    async def wait(self, download: Download) -> Download:
        """Wait for `download` to finish (at once when it has); returns it."""
        task = self._tasks.get(download.id)
        if task is not None:
            await asyncio.shield(task)
        return download

    async def _run(self, download: Download) -> None:
        logger.info("downloading %s@%s %s", download.repo_id, download.revision, list(download.files) or "(all)")
        try:
            await asyncio.to_thread(download_files, download, settings=self.settings, cache_dir=self.cache_dir)
            download.state = DownloadState.SUCCEEDED
            logger.info("downloaded %s at %s", download.repo_id, download.commit)
        except QiipError as exc:
            download.state, download.error = DownloadState.FAILED, exc.message
            logger.warning("download %s failed: %s", download.id, exc.message)
        except asyncio.CancelledError:
            download._cancel.set()
            download.state, download.error = DownloadState.FAILED, "The daemon stopped during the download."
            raise
        finally:
            download.finished_at = datetime.now(UTC)
            download._finished_mono = time.monotonic()
            self._running.pop(download.key, None)

    def get(self, download_id: str) -> Download | None:
        """A download by id."""
        return self._downloads.get(download_id)

    def list(self) -> list[Download]:
        """Every kept download, newest first."""
        return list(reversed(self._downloads.values()))

    async def aclose(self) -> None:
        """Stop running downloads (their complete files stay in the cache)."""
        for download in self._running.values():
            download._cancel.set()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
