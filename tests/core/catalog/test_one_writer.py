"""One writer per object, the bytes on disk checked before publishing, damaged objects never served, and what an
acquisition did kept in the store for every process to read: against the loopback HTTPS file server, with real
`qiip` processes where the point is another process."""

from __future__ import annotations

import gzip
import os
import signal
import ssl
import subprocess
import threading
import zlib
from pathlib import Path

import pytest

from qiip_core import ArtifactNotFound, DownloadFailed
from qiip_core.catalog import AcquisitionState, ModelStore, artifact_entrypoint
from qiip_core.config import ModelSettings, Settings
from tests.core.catalog.conftest import CHUNK, SIZE, manifest
from tests.support.cli import QIIP, clean_environ, run_qiip
from tests.support.daemon import wait_until
from tests.support.fake_hub import FileServer


def _objects(store: ModelStore) -> list[Path]:
    return sorted((store.root / "objects" / "sha256").iterdir())


def _bytes_served(server: FileServer) -> int:
    return sum(s.body_bytes for s in server.served if s.path == "/model.gguf")


def _cli_env(store: ModelStore, tls: tuple[ssl.SSLContext, Path]) -> dict[str, str]:
    return {
        "QIIP_MODELS__STORE_DIR": str(store.root),
        "QIIP_MODELS__ALLOWED_DOWNLOAD_HOSTS": '["127.0.0.1"]',
        "QIIP_MODELS__CA_BUNDLE": str(tls[1]),
        "QIIP_MODELS__CHUNK_BYTES": str(CHUNK),
    }


def _start_acquire(tmp_path: Path, env: dict[str, str], revision_id: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*QIIP, "model", "acquire", revision_id],
        env=clean_environ() | env | {"QIIP_STATE_DIR": str(tmp_path / "state")},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_revisions_in_one_process_share_one_writer(store: ModelStore, server: FileServer, blob: Path) -> None:
    server.throttle_s = 0.01
    url = server.url + "/model.gguf"
    first, _ = store.register(manifest(blob, url))
    second, _ = store.register(manifest(blob, url, revision="1" * 40))
    failures: list[BaseException] = []

    def acquire(revision_id: str) -> None:
        try:
            store.acquire(revision_id)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=acquire, args=(r.id,)) for r in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == []
    for revision in (first, second):
        status = store.status(revision.id)
        assert status.state is AcquisitionState.AVAILABLE and status.path is not None
        assert status.path.read_bytes() == blob.read_bytes()
    # One object, fetched once: the second acquisition waited for the first and used what it published.
    assert [p.name for p in _objects(store)] == [first.files[0].sha256]
    assert _bytes_served(server) == SIZE


def test_two_processes_acquiring_one_object_publish_it_once(
    tmp_path: Path, store: ModelStore, server: FileServer, blob: Path, tls: tuple[ssl.SSLContext, Path]
) -> None:
    server.throttle_s = 0.02
    url = server.url + "/model.gguf"
    first, _ = store.register(manifest(blob, url))
    second, _ = store.register(manifest(blob, url, revision="2" * 40))
    env = _cli_env(store, tls)
    one = _start_acquire(tmp_path, env, first.id)
    # The second starts once the first is writing, so that it meets a partial object.
    wait_until(lambda: store.status(first.id).bytes_done >= 2 * CHUNK, 60, "the first acquisition to write")
    assert store.status(first.id).state is AcquisitionState.ACQUIRING  # seen from this process
    two = _start_acquire(tmp_path, env, second.id)
    for process in (one, two):
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        assert "is available" in out
    assert [p.name for p in _objects(store)] == [first.files[0].sha256]
    assert _objects(store)[0].read_bytes() == blob.read_bytes()
    assert _bytes_served(server) == SIZE
    assert store.verify(first.id) == store.verify(second.id) == {"model.gguf": True}


def test_a_damaged_object_is_quarantined_and_never_served(
    tmp_path: Path, store: ModelStore, server: FileServer, blob: Path
) -> None:
    registered, _ = store.register(manifest(blob, server.url + "/model.gguf"))
    settings = Settings(state_dir=tmp_path, models=ModelSettings(store_dir=store.root, hf_cache_dir=tmp_path / "hub"))
    store.acquire(registered.id)
    path = _objects(store)[0]
    # Damage that keeps size and modification time: only hashing finds it.
    stat = path.stat()
    path.chmod(0o644)
    with path.open("r+b") as handle:
        handle.seek(SIZE // 3)
        handle.write(b"\0" * 64)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert store.verify(registered.id) == {"model.gguf": False}
    status = store.status(registered.id)
    assert status.state is AcquisitionState.FAILED and status.path is None
    assert status.error is not None and "failed verification" in status.error and "quarantine" in status.error
    assert not path.exists() and len(list((store.root / "quarantine").glob("*.2*"))) == 1
    with pytest.raises(ArtifactNotFound, match="failed verification"):
        artifact_entrypoint(settings, registered.artifact_id)
    # The next acquisition fetches it again.
    assert store.acquire(registered.id).state is AcquisitionState.AVAILABLE
    assert artifact_entrypoint(settings, registered.artifact_id).read_bytes() == blob.read_bytes()

    # Damage that changes the file is seen without hashing: it is no longer what was verified.
    path.chmod(0o644)
    with path.open("r+b") as handle:
        handle.write(b"\xff" * 16)
    assert store.status(registered.id).state is AcquisitionState.UNVERIFIED
    assert store.resolve(registered.artifact_id) is None  # hashed at the door, and quarantined
    assert store.status(registered.id).state is AcquisitionState.FAILED


def test_an_object_published_without_a_check_is_hashed_before_it_is_used(
    store: ModelStore, server: FileServer, blob: Path
) -> None:
    # What an older store holds: an object of the right size, never checked, with zeroed holes.
    registered, _ = store.register(manifest(blob, server.url + "/model.gguf"))
    damaged = bytearray(blob.read_bytes())
    damaged[CHUNK : 2 * CHUNK] = bytes(CHUNK)
    target = store.objects.object_path(registered.files[0].sha256)
    target.parent.mkdir(parents=True)
    target.write_bytes(bytes(damaged))
    assert store.status(registered.id).state is AcquisitionState.UNVERIFIED
    status = store.acquire(registered.id)
    assert status.state is AcquisitionState.AVAILABLE and status.path is not None
    assert status.path.read_bytes() == blob.read_bytes()
    assert _bytes_served(server) == SIZE
    assert len(list((store.root / "quarantine").glob("*.2*"))) == 1


def test_a_compressed_answer_is_refused_unread(store: ModelStore, server: FileServer, blob: Path) -> None:
    # A gzip bomb: 64 KiB on the wire, 64 MiB once decoded, for a manifest of 1 MiB.
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    bomb = b"".join(packer.compress(zeros) for _ in range(64)) + packer.flush()
    assert len(gzip.decompress(bomb)) == 64 << 20
    server.fixed["/bomb.gguf"] = ({"Content-Encoding": "gzip", "Content-Type": "application/octet-stream"}, bomb)
    registered, _ = store.register(manifest(blob, server.url + "/bomb.gguf"))
    with pytest.raises(DownloadFailed, match="Content-Encoding 'gzip' although 'identity' was asked for"):
        store.acquire(registered.id)
    assert server.served[0].accept_encoding == "identity"
    assert store.objects.durable_offset(registered.files[0].sha256) == 0
    assert sum(p.stat().st_size for p in (store.root / "partial").glob("*.part")) == 0
    status = store.status(registered.id)
    assert status.state is AcquisitionState.FAILED and status.error is not None and "gzip" in status.error


def test_what_an_acquisition_did_is_read_by_every_process(
    tmp_path: Path, store: ModelStore, server: FileServer, blob: Path, tls: tuple[ssl.SSLContext, Path]
) -> None:
    env = _cli_env(store, tls)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    # A failure in one process is what another process's status shows, with its reason.
    missing, _ = store.register(manifest(blob, server.url + "/absent.gguf", revision="3" * 40))
    failed = run_qiip(state_dir, "model", "acquire", missing.id, env=env)
    assert failed.returncode == 1 and "The server answered 404" in failed.stdout + failed.stderr
    shown = run_qiip(state_dir, "model", "status", missing.id, env=env)
    assert f"{missing.id}" in shown.stdout and " failed " in shown.stdout
    assert "error: The server answered 404" in shown.stdout
    assert ModelStore(store.root, allowed_hosts=[]).status(missing.id).state is AcquisitionState.FAILED

    # An acquisition killed part-way reads as interrupted, with its durable bytes, and resumes.
    server.throttle_s = 0.02
    registered, _ = store.register(manifest(blob, server.url + "/model.gguf"))
    process = _start_acquire(tmp_path, env, registered.id)
    wait_until(lambda: store.status(registered.id).bytes_done >= 2 * CHUNK, 60, "the acquisition to write")
    assert store.status(registered.id).state is AcquisitionState.ACQUIRING
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=30)
    interrupted = store.status(registered.id)
    assert interrupted.state is AcquisitionState.PARTIAL and interrupted.bytes_done >= 2 * CHUNK
    assert interrupted.error is not None and f"process {process.pid}" in interrupted.error
    server.throttle_s = 0.0
    assert store.acquire(registered.id).state is AcquisitionState.AVAILABLE
    assert server.served[-1].range is not None
    assert store.status(registered.id).error is None


def test_a_verified_object_of_another_revision_reads_unpublished_and_publishes_without_a_transfer(
    store: ModelStore, server: FileServer, blob: Path
) -> None:
    url = server.url + "/model.gguf"
    first, _ = store.register(manifest(blob, url))
    second, _ = store.register(manifest(blob, url, revision="4" * 40))
    store.acquire(first.id)
    status = store.status(second.id)
    assert (status.state, status.bytes_done, status.path) == (AcquisitionState.UNPUBLISHED, SIZE, None)
    served = len(server.served)
    assert store.acquire(second.id).state is AcquisitionState.AVAILABLE
    assert len(server.served) == served
