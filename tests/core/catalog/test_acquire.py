"""Manifests and acquisition over real HTTPS (trustme certificates): resume, restart, refusal, corruption, pause."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from qiip_core import (
    AcquisitionPaused,
    ArtifactNotFound,
    ManifestInvalid,
    ObjectMismatch,
    RevisionInUse,
    SourceNotAllowed,
)
from qiip_core.catalog import AcquisitionState, ModelStore, artifact_entrypoint
from qiip_core.config import ModelSettings, Settings
from tests.core.catalog.conftest import CHUNK, SIZE, manifest, visible
from tests.support.fake_hub import FileServer


def test_an_acquisition_is_verified_and_published_atomically(store: ModelStore, server: FileServer, blob: Path) -> None:
    registered, new = store.register(manifest(blob, server.url + "/model.gguf"))
    assert new and store.status(registered.id).state is AcquisitionState.REGISTERED
    status = store.acquire(registered.id)
    assert status.state is AcquisitionState.AVAILABLE and status.bytes_done == SIZE
    assert status.path is not None and status.path.read_bytes() == blob.read_bytes()
    assert not list((store.root / "partial").iterdir())
    assert os.stat(status.path).st_mode & 0o222 == 0  # objects are read-only
    assert store.verify(registered.id) == {"model.gguf": True}
    assert store.resolve(registered.artifact_id) == status.path


def test_a_dropped_connection_resumes_without_fetching_a_byte_twice(
    store: ModelStore, server: FileServer, blob: Path
) -> None:
    server.drop_at_fraction = 0.4
    registered, _ = store.register(manifest(blob, server.url + "/model.gguf"))
    assert store.acquire(registered.id).state is AcquisitionState.AVAILABLE
    first, second = server.served
    assert (first.status, first.range, first.body_bytes) == (200, None, int(SIZE * 0.4))
    assert (second.status, second.range) == (206, f"bytes={first.body_bytes}-")
    assert first.body_bytes + second.body_bytes == SIZE


def test_a_server_that_ignores_range_restarts_cleanly(store: ModelStore, server: FileServer, blob: Path) -> None:
    server.drop_at_fraction, server.ignore_range = 0.4, True
    registered, _ = store.register(manifest(blob, server.url + "/model.gguf"))
    status = store.acquire(registered.id)
    assert status.state is AcquisitionState.AVAILABLE and store.verify(registered.id) == {"model.gguf": True}
    assert [(s.status, s.range is not None) for s in server.served] == [(200, False), (200, True)]


def test_a_redirect_to_a_disallowed_host_is_refused(store: ModelStore, server: FileServer, blob: Path) -> None:
    port = server.url.rsplit(":", 1)[1]
    server.redirects["/moved.gguf"] = f"https://localhost:{port}/model.gguf"
    registered, _ = store.register(manifest(blob, server.url + "/moved.gguf"))
    with pytest.raises(SourceNotAllowed, match="'localhost' is not an allowed download host"):
        store.acquire(registered.id)
    assert [s.path for s in server.served] == ["/moved.gguf"]
    assert visible(store) == [] and store.status(registered.id).state is AcquisitionState.FAILED


def test_a_flipped_byte_is_never_published(store: ModelStore, server: FileServer, blob: Path) -> None:
    server.flip_byte_at = SIZE // 2
    registered, _ = store.register(manifest(blob, server.url + "/model.gguf"))
    with pytest.raises(ObjectMismatch, match="discarded"):
        store.acquire(registered.id)
    assert visible(store) == [] and not list((store.root / "partial").iterdir())
    server.flip_byte_at = None
    assert store.acquire(registered.id).state is AcquisitionState.AVAILABLE


def test_pause_keeps_a_durable_offset_and_acquire_resumes_it(store: ModelStore, server: FileServer, blob: Path) -> None:
    server.throttle_s = 0.02
    registered, _ = store.register(manifest(blob, server.url + "/model.gguf"))
    failure: list[BaseException] = []

    def run() -> None:
        try:
            store.acquire(registered.id)
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while store.status(registered.id).bytes_done < 2 * CHUNK and time.monotonic() < deadline:
        time.sleep(0.01)
    store.pause(registered.id)
    thread.join(timeout=30)
    assert failure and isinstance(failure[0], AcquisitionPaused)
    paused = store.status(registered.id)
    assert paused.state is AcquisitionState.PAUSED and 0 < paused.bytes_done < SIZE
    server.throttle_s = 0.0
    assert store.acquire(registered.id).state is AcquisitionState.AVAILABLE
    assert server.served[-1].range == f"bytes={paused.bytes_done}-"
    assert visible(store) != [] and store.verify(registered.id) == {"model.gguf": True}


def test_a_local_upload_takes_the_same_path(store: ModelStore, blob: Path) -> None:
    registered, _ = store.register(manifest(blob, None))
    status = store.acquire(registered.id, local_dir=blob.parent)
    assert status.state is AcquisitionState.AVAILABLE and status.path is not None
    assert status.path.read_bytes() == blob.read_bytes()


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"entrypoint": "other.gguf"}, "entrypoint"),
        ({"files": [{"name": "model.gguf", "digest": "md5:00", "bytes": 1}]}, "files.0.digest"),
        ({"files": [{"name": "../x.gguf", "digest": "sha256:" + "0" * 64, "bytes": 1}]}, "files.0.name"),
        (
            {
                "files": [
                    {"name": "model.gguf", "digest": "sha256:" + "0" * 64, "bytes": 1, "url": "http://127.0.0.1/x"}
                ]
            },
            "files.0.url",
        ),
        (
            {
                "files": [
                    {"name": "model.gguf", "digest": "sha256:" + "0" * 64, "bytes": 1, "url": "https://u:p@127.0.0.1/x"}
                ]
            },
            "files.0.url",
        ),
        (
            {
                "files": [
                    {"name": "model.gguf", "digest": "sha256:" + "0" * 64, "bytes": 1, "url": "https://evil.example/x"}
                ]
            },
            "files.0.url",
        ),
        ({"licence": ""}, "licence"),
    ],
)
def test_invalid_manifests_name_each_violation(
    store: ModelStore, blob: Path, changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(ManifestInvalid) as info:
        store.register(manifest(blob, None, **changes))
    assert field in [v.field for v in info.value.violations]
    assert store.manifests() == []


def test_a_registered_revision_is_never_replaced(store: ModelStore, blob: Path) -> None:
    first, new = store.register(manifest(blob, None))
    again, new_again = store.register(manifest(blob, None))
    assert new and not new_again and again.id == first.id
    with pytest.raises(RevisionInUse, match="never replaced"):
        store.register(manifest(blob, None, name="Another name"))
    assert [m.id for m in store.manifests()] == [first.id]


def test_bytes_complete_before_a_stop_are_verified_and_published_without_a_request(
    store: ModelStore, server: FileServer, blob: Path
) -> None:
    registered, _ = store.register(manifest(blob, server.url + "/model.gguf"))
    sha256 = registered.files[0].sha256
    partial = store.root / "partial"
    partial.mkdir(parents=True)
    (partial / f"{sha256}.part").write_bytes(blob.read_bytes())
    (partial / f"{sha256}.offset").write_text(f'{{"offset": {SIZE}}}')
    assert store.status(registered.id).state is AcquisitionState.PARTIAL
    assert store.acquire(registered.id).state is AcquisitionState.AVAILABLE
    assert server.served == []


def test_a_partial_object_past_its_durable_offset_is_cut_back(
    store: ModelStore, server: FileServer, blob: Path
) -> None:
    registered, _ = store.register(manifest(blob, server.url + "/model.gguf"))
    sha256 = registered.files[0].sha256
    partial = store.root / "partial"
    partial.mkdir(parents=True)
    # 3 chunks on disk, only 2 acknowledged: the third may be torn, so it is fetched again.
    (partial / f"{sha256}.part").write_bytes(blob.read_bytes()[: 3 * CHUNK - 7] + b"garbage")
    (partial / f"{sha256}.offset").write_text(f'{{"offset": {2 * CHUNK}}}')
    assert store.acquire(registered.id).state is AcquisitionState.AVAILABLE
    assert [s.range for s in server.served] == [f"bytes={2 * CHUNK}-"]


def test_an_artifact_resolves_only_once_its_revision_is_acquired(
    tmp_path: Path, store: ModelStore, server: FileServer, blob: Path
) -> None:
    settings = Settings(state_dir=tmp_path, models=ModelSettings(store_dir=store.root, hf_cache_dir=tmp_path / "hub"))
    registered, _ = store.register(manifest(blob, server.url + "/model.gguf"))
    with pytest.raises(ArtifactNotFound) as refused:
        artifact_entrypoint(settings, registered.artifact_id)
    assert refused.value.message == (
        f"Artifact {registered.artifact_id} is revision {registered.id}, which is registered, not available; "
        f"`qiip model acquire {registered.id}` completes it."
    )
    store.acquire(registered.id)
    assert artifact_entrypoint(settings, registered.artifact_id).read_bytes() == blob.read_bytes()
    with pytest.raises(ArtifactNotFound, match="No GGUF generation with artifact_id"):
        artifact_entrypoint(settings, "d" * 64)


def test_a_source_whose_name_resolves_to_a_metadata_address_is_refused_before_any_request(
    tmp_path: Path, tls: tuple[object, Path], server: FileServer, blob: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qiip_core.nodes import _connect

    monkeypatch.setattr(_connect, "resolve", lambda host, port: ["169.254.169.254"])
    store = ModelStore(tmp_path / "store", allowed_hosts=["mirror.lab"], chunk_bytes=CHUNK, ca_bundle=tls[1])
    port = server.url.rsplit(":", 1)[1]
    registered, _ = store.register(manifest(blob, f"https://mirror.lab:{port}/model.gguf"))
    with pytest.raises(SourceNotAllowed, match=r"the source of model.gguf: mirror.lab \(which resolves to 169.254"):
        store.acquire(registered.id)
    assert server.served == [] and visible(store) == []
    assert store.status(registered.id).state is AcquisitionState.FAILED
