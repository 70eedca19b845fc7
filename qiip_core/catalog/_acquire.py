"""Acquire one object: one writer, bounded chunks, a durable offset, `Range` resume, the bytes on disk checked,
atomic publish, and a record of the check.

```
locks/sha256/<sha256>.lock    flock: held by the one acquisition (any process) writing this object
partial/<sha256>.part         the bytes so far          (never visible under objects/)
partial/<sha256>.offset       {"offset": n}             written (fsync, rename) after each chunk is fsynced
objects/sha256/<sha256>       the verified object       (read-only; renamed into place only after the check)
verified/sha256/<sha256>.json {"bytes", "mtime_ns", "ino", "verified_at"}: the object as it was when last hashed
quarantine/<sha256>.<time>    an object that failed a check, moved aside (never served); <sha256>.json says why
```

One writer per object: an acquisition takes an exclusive `flock` on the object's lock file before it touches the
partial file, and holds it until the object is published or the acquisition stops. A second acquisition of the
same object, from another thread, process or gateway on the same store, waits for it (a pause still stops the
wait) and then finds the object published: it joins the first rather than writing beside it.

A transfer resumes from the recorded offset with `Range: bytes=<offset>-` (RFC 9110 §14.2). A `206` whose
`Content-Range` starts at the offset is appended; a `200` means the server ignored the range, so the partial file is
truncated and the transfer restarts cleanly from byte 0. A broken connection keeps every byte received (the bytes
are written and made durable before the error propagates), and the next attempt asks only for the rest. Redirects
are followed by hand, at most five, each target checked against the host allowlist first. The answer must not be
encoded: `Accept-Encoding: identity` is asked for, an answer with any other `Content-Encoding` is refused, and the
body is read raw, so a compressed answer can never expand past the manifest's size.

The SHA-256 is taken over the bytes **as read back from the file**, chunk by chunk after each is fsynced (the part
before a resume is read back once), never over the bytes as received; the object is published only when that
digest and the size match the manifest. A mismatch deletes the partial object (`ObjectMismatch`). The store "has"
an object only when it is published and its verification record still describes the file (size, modification
time, inode); an object without one (an older store) or that changed is hashed again before it is used, and one
that fails is moved to `quarantine/`, never served. Local uploads take the same path, reading from a file instead
of a connection.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import logging
import os
import queue
import re
import ssl
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

from qiip_core._errors import AcquisitionPaused, DownloadFailed, ObjectMismatch, SourceNotAllowed
from qiip_core.catalog._files import HASH_BLOCK, exclusive_lock, fsync_dir, hash_back, lock_held, sha256_of, write_all
from qiip_core.catalog._manifest import ManifestFile, check_source_url
from qiip_core.nodes import AddressRefused, checked_create_connection
from qiip_core.storage import atomic_write

__all__ = ["ObjectStore", "Reader", "Transfer"]

logger = logging.getLogger("qiip.catalog")

MAX_REDIRECTS = 5
ATTEMPTS = 3
"""Connections one acquisition of an object opens before it gives up (each resumes the last)."""
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_WRITE_BYTES = 1 << 20
"""Bytes read (from the connection or a local file) into one buffer, then written with one `pwrite`."""
_TIMEOUT_S = 30.0
"""Seconds a connection may stay silent before the attempt counts as broken."""
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


Reader = Callable[[memoryview], int]
"""Fills a buffer with the next bytes of the source and says how many (0 at its end): `readinto`."""


class Transfer:
    """What one object's acquisition reports: bytes durable so far (for progress), and whether to stop."""

    def __init__(self, *, should_pause: Callable[[], bool] = lambda: False) -> None:
        self.bytes_done = 0
        self.should_pause = should_pause
        self.waiting_for: str | None = None
        """The object whose other writer this acquisition waits for, while it waits."""

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

    def lock_path(self, sha256: str) -> Path:
        """The object's writer lock (`exclusive_lock`)."""
        return self.root / "locks" / "sha256" / f"{sha256}.lock"

    def _record(self, sha256: str) -> Path:
        return self.root / "verified" / "sha256" / f"{sha256}.json"

    def _quarantine_note(self, sha256: str) -> Path:
        return self.root / "quarantine" / f"{sha256}.json"

    def has(self, file: ManifestFile) -> bool:
        """Whether the object is published and verified: its verification record matches the file on disk (size,
        modification time, inode) and the manifest's size. Cheap (two `stat`s and a small read); never hashes."""
        try:
            stat = self.object_path(file.sha256).stat()
            record = json.loads(self._record(file.sha256).read_bytes())
        except (OSError, ValueError):
            return False
        return (
            isinstance(record, dict)
            and stat.st_size == file.bytes
            and record.get("bytes") == stat.st_size
            and record.get("mtime_ns") == stat.st_mtime_ns
            and record.get("ino") == stat.st_ino
        )

    def present(self, file: ManifestFile) -> bool:
        """Whether an object of the right size is published, verified or not (`has` says whether it is)."""
        try:
            return self.object_path(file.sha256).stat().st_size == file.bytes
        except OSError:
            return False

    def trusted(self, file: ManifestFile, *, check: Callable[[], None] = lambda: None) -> bool:
        """`has`, or, for an object published without a matching record (an older store, a file changed on disk),
        hash it now under the object's lock: a match writes the record, a mismatch quarantines the object.

        Returns:
            Whether the object may be used.
        """
        if self.has(file):
            return True
        if not self.object_path(file.sha256).exists():
            return False
        with exclusive_lock(self.lock_path(file.sha256), check=check):
            return self._check_published(file)

    def _check_published(self, file: ManifestFile) -> bool:
        """Hash a published object (the caller holds its lock); record it, or quarantine it."""
        path = self.object_path(file.sha256)
        if self.has(file):
            return True
        try:
            size = path.stat().st_size
            actual = sha256_of(path)
        except FileNotFoundError:
            return False
        if size == file.bytes and actual == file.sha256:
            self._write_record(file.sha256)
            return True
        what = f"{size:,} bytes" if size != file.bytes else f"SHA-256 {actual}"
        self.quarantine(file.sha256, f"{file.name} has {what} on disk, not {file.bytes:,} bytes with {file.digest}")
        return False

    def verify(self, file: ManifestFile) -> bool:
        """Hash a published object again (under its lock); True when it matches its manifest entry.

        A match refreshes its verification record; a mismatch moves it to `quarantine/` (so no node is launched on
        it and the next acquisition fetches it again).
        """
        path = self.object_path(file.sha256)
        if not path.exists():
            return False
        with exclusive_lock(self.lock_path(file.sha256)):
            with contextlib.suppress(FileNotFoundError):
                self._record(file.sha256).unlink()
            return self._check_published(file)

    def quarantine(self, sha256: str, reason: str) -> Path | None:
        """Move a published object aside (`quarantine/<sha256>.<UTC time>`) with a note of why; the caller holds the
        object's lock. Returns where it went (None when it was gone already)."""
        now = datetime.now(UTC)
        target = self.root / "quarantine" / f"{sha256}.{now.strftime('%Y%m%dT%H%M%S.%fZ')}"
        target.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self._record(sha256).unlink()
        try:
            os.replace(self.object_path(sha256), target)
        except FileNotFoundError:
            return None
        note = {"sha256": sha256, "reason": reason, "moved_to": str(target), "at": now.isoformat()}
        atomic_write(self._quarantine_note(sha256), json.dumps(note).encode(), mode=0o644)
        logger.warning("quarantined object %s: %s; moved to %s", sha256, reason, target)
        return target

    def quarantined(self, sha256: str) -> dict[str, Any] | None:
        """The note of this object's last quarantine (`reason`, `moved_to`, `at`), or None."""
        try:
            note = json.loads(self._quarantine_note(sha256).read_bytes())
        except (OSError, ValueError):
            return None
        return note if isinstance(note, dict) else None

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

        Only one acquisition writes an object at a time: this waits (pausable) while another holds it, and returns
        at once when that one published it.

        Args:
            file: the manifest entry (name, digest, size, URL).
            allowed_hosts: `models.allowed_download_hosts`.
            transfer: progress and pause.
            verify: TLS verification: True for the system's authorities, or a context trusting a CA bundle.
            local: a local file to upload instead of fetching `file.url`.

        Raises:
            SourceNotAllowed: the URL or a redirect is not HTTPS on an allowed host, or carries credentials, or its
                host is (or resolves to) a link-local, unspecified or metadata address (`qiip_core.nodes`).
            ObjectMismatch: the bytes on disk differ in size or SHA-256 from the manifest; the partial object is
                deleted.
            AcquisitionPaused: a pause was asked for; the offset is durable.
            DownloadFailed: no URL and no local file, the server refused or answered encoded, or the connection kept
                breaking.
        """
        if self.has(file):
            transfer.bytes_done = file.bytes
            return self.object_path(file.sha256)
        if local is None and file.url is None:
            raise DownloadFailed(f"{file.name} has no URL in the manifest; upload it from a local file.")
        if local is None:
            assert file.url is not None
            check_source_url(file.url, allowed_hosts)
        lock = self.lock_path(file.sha256)
        if lock_held(lock):
            transfer.waiting_for = file.name
            logger.info("acquiring %s: another acquisition writes it; waiting for it", file.name)
        try:
            with exclusive_lock(lock, check=transfer.check):
                transfer.waiting_for = None
                if self.object_path(file.sha256).exists() and self._check_published(file):
                    transfer.bytes_done = file.bytes
                    return self.object_path(file.sha256)
                return self._acquire_locked(file, allowed_hosts, transfer, verify, local)
        finally:
            transfer.waiting_for = None

    def _acquire_locked(
        self,
        file: ManifestFile,
        allowed_hosts: list[str],
        transfer: Transfer,
        verify: ssl.SSLContext | bool,
        local: Path | None,
    ) -> Path:
        (self.root / "partial").mkdir(parents=True, exist_ok=True)
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
            except _Broken as exc:
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
        """Fetch from `offset` to the end; returns the SHA-256 of the whole object (None when it was complete).

        The standard library's HTTP client reads the body straight into the write buffer (`readinto`, its loop over
        TLS records in C), where a general client's per-record machinery cost most of the transfer's time
        (docs/performance.md).
        """
        context = verify if isinstance(verify, ssl.SSLContext) else ssl.create_default_context()
        if verify is False:
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        headers = {"Accept-Encoding": "identity", "User-Agent": "qiip"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        for _ in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            connection = http.client.HTTPSConnection(
                parts.hostname or "", parts.port or 443, context=context, timeout=_TIMEOUT_S
            )
            # The source's name is resolved and held to the address rule when it is connected to (qiip_core.nodes).
            connection._create_connection = checked_create_connection(  # type: ignore[attr-defined]
                setting=f"the source of {file.name}"
            )
            try:
                try:
                    connection.request(
                        "GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), headers=headers
                    )
                    response = connection.getresponse()
                except AddressRefused as exc:
                    raise SourceNotAllowed(f"The acquisition of {file.name} is refused: {exc}.") from None
                except (OSError, http.client.HTTPException) as exc:
                    raise _Broken(f"{type(exc).__name__}: {exc}") from exc
                location = response.getheader("location")
                if response.status in _REDIRECTS and location:
                    url = check_source_url(urljoin(url, location), allowed)
                    continue
                if response.status == 416 and offset == file.bytes:
                    return None
                if response.status not in (200, 206):
                    raise DownloadFailed(
                        f"The server answered {response.status} for {file.name}; check the manifest's URL."
                    )
                encoding = (response.getheader("content-encoding") or "identity").strip().lower()
                if encoding not in ("", "identity"):
                    # Decoding would let a small answer expand without bound before any size check; it is never
                    # decoded, and refused unread.
                    raise DownloadFailed(
                        f"The server answered {file.name} with Content-Encoding {encoding[:40]!r} although "
                        "'identity' was asked for; an acquisition accepts the file's own bytes only. Fix the "
                        "server, or give another URL."
                    )
                start = 0
                if response.status == 206:
                    match = _CONTENT_RANGE.match(response.getheader("content-range") or "")
                    if match is None or int(match.group(1)) != offset:
                        raise _Broken(f"a 206 answer's Content-Range does not start at byte {offset}")
                    start = offset
                elif offset:
                    logger.info("%s ignored the Range request; restarting %s from byte 0", parts.hostname, file.name)
                return self._write(file, start, _reader(response), transfer)
            finally:
                connection.close()
        raise DownloadFailed(f"{file.name}: more than {MAX_REDIRECTS} redirects.")

    def _copy_local(self, file: ManifestFile, local: Path, offset: int, transfer: Transfer) -> str:
        try:
            handle = local.open("rb")
        except OSError as exc:
            raise DownloadFailed(f"The local file {local} cannot be read: {exc.strerror}.") from exc
        with handle:
            handle.seek(offset)
            return self._write(file, offset, handle.readinto, transfer)

    def _write(self, file: ManifestFile, start: int, readinto: Reader, transfer: Transfer) -> str:
        """Write what `readinto` gives at `start`, making each `chunk_bytes` durable before recording the new offset.

        The bytes are read into one buffer (`_WRITE_BYTES`, or `chunk_bytes` when smaller) and written from it; a
        second thread makes each `chunk_bytes` durable (fsync), reads it back and hashes what it read, then records
        the offset, while this one goes on receiving. What was received is kept, even when the connection broke or a
        pause was asked for (a connection reset loses at most the one read it interrupted): the durable offset is
        where the next attempt resumes.

        Returns:
            The SHA-256 of the whole partial object as read back from the file: the bytes before `start` once, the
            rest chunk by chunk after each is fsynced. A complete object is not read a third time to be checked.
        """
        part = self._part(file.sha256)
        fd = os.open(part, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, start)
            digest = hashlib.sha256()
            hash_back(fd, digest, 0, start)
            durable = _Durable(self, file, fd, digest, start, transfer)
            buffer = memoryview(bytearray(min(_WRITE_BYTES, self.chunk_bytes)))
            written = start
            try:
                while n := readinto(buffer):
                    write_all(fd, buffer[:n], written)
                    written += n
                    if written > file.bytes:
                        break  # more bytes than the manifest says: the size check discards the object
                    if written - durable.submitted >= self.chunk_bytes:
                        durable.submit(written)
                        transfer.check()
            finally:
                # Whatever arrived is kept, even when the connection broke or a pause was asked for.
                durable.submit(written)
                durable.close()
        finally:
            os.close(fd)
        if durable.done < file.bytes:
            raise _Broken(f"the source ended at byte {durable.done:,} of {file.bytes:,}")
        return digest.hexdigest()

    def _verify_and_publish(self, file: ManifestFile, digest: str | None) -> Path:
        """Check size and SHA-256 (`digest`, taken from the file as read back, else read back now), then rename the
        object into place and record the check; a mismatch deletes it."""
        part = self._part(file.sha256)
        size = part.stat().st_size
        actual = digest if digest is not None else sha256_of(part)
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
        fsync_dir(target.parent)
        self._write_record(file.sha256)
        with contextlib.suppress(FileNotFoundError):
            self._offset_file(file.sha256).unlink()
        logger.info("published %s as %s", file.name, target)
        return target

    def _write_record(self, sha256: str) -> None:
        stat = self.object_path(sha256).stat()
        record = {
            "bytes": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "ino": stat.st_ino,
            "verified_at": datetime.now(UTC).isoformat(),
        }
        atomic_write(self._record(sha256), json.dumps(record).encode(), mode=0o644)

    def discard(self, sha256: str) -> None:
        """Delete a partial object and its offset."""
        for path in (self._part(sha256), self._offset_file(sha256)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


class _Broken(Exception):
    """The transfer ended before the last byte (the connection closed early, or a malformed range answer)."""


def _reader(response: http.client.HTTPResponse) -> Reader:
    """Read a response's body into a buffer as it arrives (0 at its end); a broken connection is `_Broken`."""

    def readinto(buffer: memoryview) -> int:
        try:
            return response.readinto(buffer)
        except (OSError, http.client.HTTPException) as exc:
            raise _Broken(f"the connection broke: {type(exc).__name__}: {exc}") from exc

    return readinto


class _Durable:
    """The thread that makes written bytes durable, in order: fsync, read back and hash, record the offset.

    `submit(end)` hands it `[last end, end)`; at most two ranges wait, so the receiving side never runs far ahead of
    the disk. `close()` waits for every range and raises what the thread met (a disk error).
    """

    def __init__(self, store: ObjectStore, file: ManifestFile, fd: int, digest: Any, start: int, transfer: Transfer):
        self.store, self.file, self.fd, self.digest, self.transfer = store, file, fd, digest, transfer
        self.submitted = self.done = start
        self.error: BaseException | None = None
        self._ranges: queue.Queue[tuple[int, int] | None] = queue.Queue(maxsize=2)
        self._thread = threading.Thread(target=self._run, name="qiip-acquire-durable", daemon=True)
        self._thread.start()

    def submit(self, end: int) -> None:
        if end > self.submitted and self.error is None:
            self._ranges.put((self.submitted, end))
            self.submitted = end

    def close(self) -> None:
        self._ranges.put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        buffer = bytearray(8 * HASH_BLOCK)
        while (item := self._ranges.get()) is not None:
            if self.error is not None:
                continue
            begin, end = item
            try:
                os.fsync(self.fd)
                hash_back(self.fd, self.digest, begin, end, buffer)
                atomic_write(self.store._offset_file(self.file.sha256), json.dumps({"offset": end}).encode())
            except BaseException as exc:  # handed to close(), in the receiving thread
                self.error = exc
                continue
            self.done = self.transfer.bytes_done = end
