"""Acquire one object: bounded chunks, a durable offset, `Range` resume, SHA-256 and size checked, atomic publish.

```
partial/<sha256>.part     the bytes so far          (never visible under objects/)
partial/<sha256>.offset   {"offset": n}             written (fsync, rename) after each chunk is fsynced
objects/sha256/<sha256>   the verified object       (read-only; renamed into place only after the check)
```

A transfer resumes from the recorded offset with `Range: bytes=<offset>-` (RFC 9110 §14.2). A `206` whose
`Content-Range` starts at the offset is appended; a `200` means the server ignored the range, so the partial file is
truncated and the transfer restarts cleanly from byte 0. A broken connection keeps every byte received (the buffer
is written and made durable before the error propagates), and the next attempt asks only for the rest. Redirects are
followed by hand, at most five, each target checked against the host allowlist first. When every byte is there the
file's size and SHA-256 (of the bytes as they were written; the part before a resume is read back once) are
checked; a size or digest mismatch deletes the partial object (`ObjectMismatch`), a match renames it to its
digest's name. Local uploads take the same path, reading from a file instead of a connection.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from qiip_core._errors import AcquisitionPaused, DownloadFailed, ObjectMismatch
from qiip_core.catalog._manifest import ManifestFile, check_source_url
from qiip_core.storage import atomic_write

__all__ = ["ObjectStore", "Transfer"]

logger = logging.getLogger("qiip.catalog")

MAX_REDIRECTS = 5
ATTEMPTS = 3
"""Connections one acquisition of an object opens before it gives up (each resumes the last)."""
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_HASH_BLOCK = 1 << 20


class Transfer:
    """What one object's acquisition reports: bytes durable so far (for progress), and whether to stop."""

    def __init__(self, *, should_pause: Callable[[], bool] = lambda: False) -> None:
        self.bytes_done = 0
        self.should_pause = should_pause

    def check(self) -> None:
        """Raise `AcquisitionPaused` when a pause was asked for."""
        if self.should_pause():
            raise AcquisitionPaused("The acquisition was paused; acquire again to resume at its durable offset.")


class ObjectStore:
    """Verified objects by SHA-256, and the partial ones being acquired.

    Args:
        root: the store directory (`models.store_dir`).
        chunk_bytes: bytes per durable write.
    """

    def __init__(self, root: Path, *, chunk_bytes: int = 16 * 1024 * 1024) -> None:
        self.root = root
        self.chunk_bytes = chunk_bytes

    def object_path(self, sha256: str) -> Path:
        """Where the verified object with this digest lives."""
        return self.root / "objects" / "sha256" / sha256

    def _part(self, sha256: str) -> Path:
        return self.root / "partial" / f"{sha256}.part"

    def _offset_file(self, sha256: str) -> Path:
        return self.root / "partial" / f"{sha256}.offset"

    def has(self, file: ManifestFile) -> bool:
        """Whether the verified object is present with the right size."""
        path = self.object_path(file.sha256)
        return path.is_file() and path.stat().st_size == file.bytes

    def durable_offset(self, sha256: str) -> int:
        """The bytes of a partial object known to be on disk (0 when none)."""
        try:
            recorded = int(json.loads(self._offset_file(sha256).read_text())["offset"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0
        try:
            return min(recorded, self._part(sha256).stat().st_size)
        except OSError:
            return 0

    def acquire(
        self,
        file: ManifestFile,
        *,
        allowed_hosts: list[str],
        transfer: Transfer,
        verify: ssl.SSLContext | bool = True,
        local: Path | None = None,
    ) -> Path:
        """Fetch (or upload from `local`) `file`, verify it and publish it; returns the object's path.

        Args:
            file: the manifest entry (name, digest, size, URL).
            allowed_hosts: `models.allowed_download_hosts`.
            transfer: progress and pause.
            verify: TLS verification: True for the system's authorities, or a context trusting a CA bundle.
            local: a local file to upload instead of fetching `file.url`.

        Raises:
            SourceNotAllowed: the URL or a redirect is not HTTPS on an allowed host, or carries credentials.
            ObjectMismatch: the bytes' size or SHA-256 differ from the manifest; the partial object is deleted.
            AcquisitionPaused: a pause was asked for; the offset is durable.
            DownloadFailed: no URL and no local file, the server refused, or the connection kept breaking.
        """
        if self.has(file):
            transfer.bytes_done = file.bytes
            return self.object_path(file.sha256)
        (self.root / "partial").mkdir(parents=True, exist_ok=True)
        if local is None and file.url is None:
            raise DownloadFailed(f"{file.name} has no URL in the manifest; upload it from a local file.")
        if local is None:
            assert file.url is not None
            check_source_url(file.url, allowed_hosts)
        digest: str | None = None
        for attempt in range(1, ATTEMPTS + 1):
            offset = self._prepare(file)
            transfer.bytes_done = offset
            if offset >= file.bytes:
                break
            try:
                if local is not None:
                    digest = self._copy_local(file, local, offset, transfer)
                else:
                    assert file.url is not None
                    digest = self._fetch(file, file.url, offset, allowed_hosts, transfer, verify)
                break
            except (httpx.TransportError, _Broken) as exc:
                logger.warning(
                    "acquiring %s: attempt %d broke at byte %d: %s", file.name, attempt, transfer.bytes_done, exc
                )
                if attempt == ATTEMPTS:
                    raise DownloadFailed(
                        f"The transfer of {file.name} broke {ATTEMPTS} times (last: {exc}); {transfer.bytes_done:,} "
                        "bytes are kept and the next acquisition resumes there."
                    ) from exc
        return self._verify_and_publish(file, digest)

    def _prepare(self, file: ManifestFile) -> int:
        """Cut the partial file back to its durable offset (bytes past it were never acknowledged)."""
        offset = self.durable_offset(file.sha256)
        part = self._part(file.sha256)
        with part.open("ab") as handle:
            handle.truncate(offset)
        return offset

    def _fetch(
        self,
        file: ManifestFile,
        url: str,
        offset: int,
        allowed: list[str],
        transfer: Transfer,
        verify: ssl.SSLContext | bool,
    ) -> str | None:
        """Fetch from `offset` to the end; returns the SHA-256 of the whole object (None when it was complete)."""
        headers = {"Accept-Encoding": "identity"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        with httpx.Client(verify=verify, trust_env=False, follow_redirects=False, timeout=30.0) as client:
            for _ in range(MAX_REDIRECTS + 1):
                with client.stream("GET", url, headers=headers) as response:
                    if response.is_redirect:
                        url = check_source_url(str(response.url.join(response.headers["location"])), allowed)
                        continue
                    if response.status_code == 416 and offset == file.bytes:
                        return None
                    if response.status_code not in (200, 206):
                        raise DownloadFailed(
                            f"The server answered {response.status_code} for {file.name}; check the manifest's URL."
                        )
                    start = 0
                    if response.status_code == 206:
                        match = _CONTENT_RANGE.match(response.headers.get("content-range", ""))
                        if match is None or int(match.group(1)) != offset:
                            raise _Broken(f"a 206 answer's Content-Range does not start at byte {offset}")
                        start = offset
                    elif offset:
                        logger.info("%s ignored the Range request; restarting %s from byte 0", url, file.name)
                    return self._write(file, start, response.iter_bytes(), transfer)
            raise DownloadFailed(f"{file.name}: more than {MAX_REDIRECTS} redirects.")

    def _copy_local(self, file: ManifestFile, local: Path, offset: int, transfer: Transfer) -> str:
        try:
            handle = local.open("rb")
        except OSError as exc:
            raise DownloadFailed(f"The local file {local} cannot be read: {exc.strerror}.") from exc
        with handle:
            handle.seek(offset)
            return self._write(file, offset, iter(lambda: handle.read(1 << 20), b""), transfer)

    def _write(self, file: ManifestFile, start: int, chunks: Iterator[bytes], transfer: Transfer) -> str:
        """Write `chunks` at `start`, making each `chunk_bytes` durable before recording the new offset.

        Returns:
            The SHA-256 of the whole partial object (the bytes before `start` read back, the rest hashed as written),
            so a complete object is not read again to be checked.
        """
        part = self._part(file.sha256)
        digest = hashlib.sha256()
        with part.open("r+b") as handle:
            handle.truncate(start)
            while handle.tell() < start and (block := handle.read(min(_HASH_BLOCK, start - handle.tell()))):
                digest.update(block)
            handle.seek(start)
            offset, buffered = start, bytearray()

            def flush() -> None:
                nonlocal offset
                if buffered:
                    digest.update(buffered)
                    handle.write(buffered)
                    handle.flush()
                    os.fsync(handle.fileno())
                    offset += len(buffered)
                    buffered.clear()
                    atomic_write(self._offset_file(file.sha256), json.dumps({"offset": offset}).encode())
                    transfer.bytes_done = offset

            try:
                for chunk in chunks:
                    buffered += chunk
                    if offset + len(buffered) > file.bytes:
                        break  # more bytes than the manifest says: the check below discards it
                    if len(buffered) >= self.chunk_bytes:
                        flush()
                        transfer.check()
            finally:
                # Whatever arrived is kept, even when the connection broke or a pause was asked for.
                flush()
        if offset < file.bytes:
            raise _Broken(f"the source ended at byte {offset:,} of {file.bytes:,}")
        return digest.hexdigest()

    def _verify_and_publish(self, file: ManifestFile, digest: str | None) -> Path:
        """Check size and SHA-256 (`digest` when the bytes were hashed as written, else read back), then rename the
        object into place; a mismatch deletes it."""
        part = self._part(file.sha256)
        size = part.stat().st_size
        actual = digest if digest is not None else _sha256_of(part)
        if size != file.bytes or actual != file.sha256:
            self.discard(file.sha256)
            what = f"{size:,} bytes" if size != file.bytes else f"SHA-256 {actual}"
            raise ObjectMismatch(
                f"{file.name} does not match its manifest: got {what}, expected {file.bytes:,} bytes with "
                f"{file.digest}. The partial object was discarded; check the source and acquire again."
            )
        target = self.object_path(file.sha256)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(part, 0o444)
        os.replace(part, target)
        _fsync_dir(target.parent)
        with contextlib.suppress(FileNotFoundError):
            self._offset_file(file.sha256).unlink()
        logger.info("published %s as %s", file.name, target)
        return target

    def discard(self, sha256: str) -> None:
        """Delete a partial object and its offset."""
        for path in (self._part(sha256), self._offset_file(sha256)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def verify(self, file: ManifestFile) -> bool:
        """Hash a published object again; True when it still matches its manifest entry."""
        path = self.object_path(file.sha256)
        if not path.is_file() or path.stat().st_size != file.bytes:
            return False
        return _sha256_of(path) == file.sha256


class _Broken(Exception):
    """The transfer ended before the last byte (the connection closed early, or a malformed range answer)."""


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
