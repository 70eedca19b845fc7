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
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from qiip_core._errors import DownloadFailed, QiipError

if TYPE_CHECKING:
    from qiip_core.config import ModelSettings

__all__ = ["Download", "DownloadManager", "DownloadState", "download_files"]

logger = logging.getLogger("qiip.catalog")

_COMMIT_LENGTH = 40


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
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    finished_at: datetime | None = None
    error: str | None = None
    _started_mono: float = field(default_factory=time.monotonic)
    _finished_mono: float = 0.0
    _transferred: int = 0
    _cancel: threading.Event = field(default_factory=threading.Event)

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

    endpoint = settings.hub_endpoint
    token: str | bool = settings.hub_token.get_secret_value() if settings.hub_token else False
    what = f"{download.repo_id}@{download.revision}"
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(
            download.repo_id, revision=download.revision, files_metadata=True
        )
        if not info.sha:
            raise DownloadFailed(f"The hub did not name the commit of {what}; it is not a Hugging Face hub.")
        download.commit = info.sha
        sizes = {s.rfilename: s.size for s in info.siblings or []}
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
            download.current_file = name

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
        download.current_file = None
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
    """Point `refs/<ref>` at `commit` atomically, without a trailing newline (huggingface_hub's own format)."""
    from huggingface_hub.file_download import repo_folder_name

    path = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model") / "refs" / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own: two downloads of one repository may point the same ref at once.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    tmp.write_text(commit)
    tmp.replace(path)


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
