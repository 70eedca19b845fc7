"""Fixtures of the acquisition tests: a loopback HTTPS file server with a `trustme` certificate, a random 1 MiB
object, a store that writes it in 64 KiB chunks, and a manifest for it."""

from __future__ import annotations

import hashlib
import os
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from qiip_core.catalog import ModelStore
from tests.support.fake_hub import FileServer

SIZE = 1 << 20
CHUNK = 64 * 1024


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, Path]:
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    bundle = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    return context, bundle


@pytest.fixture(scope="module")
def blob(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("objects") / "model.gguf"
    path.write_bytes(os.urandom(SIZE))
    return path


@pytest.fixture
def server(tls: tuple[ssl.SSLContext, Path], blob: Path) -> Iterator[FileServer]:
    fake = FileServer(tls[0])
    fake.files["/model.gguf"] = blob
    with fake.running():
        yield fake


@pytest.fixture
def store(tmp_path: Path, tls: tuple[ssl.SSLContext, Path]) -> ModelStore:
    return ModelStore(tmp_path / "store", allowed_hosts=["127.0.0.1"], chunk_bytes=CHUNK, ca_bundle=tls[1])


def manifest(blob: Path, url: str | None, **changes: Any) -> dict[str, Any]:
    """A manifest of one file, `model.gguf` (the 1 MiB object), fetched from `url` (or uploaded, without one)."""
    data: dict[str, Any] = {
        "name": "Test model",
        "revision": "0" * 40,
        "source": "publisher/model",
        "licence": "Apache-2.0",
        "format": "gguf",
        "quantization": "F16",
        "entrypoint": "model.gguf",
        "capabilities": ["chat"],
        "files": [
            {"name": "model.gguf", "digest": "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest(), "bytes": SIZE}
            | ({"url": url} if url else {})
        ],
    }
    return data | changes


def visible(store: ModelStore) -> list[str]:
    """Every file under objects/ and revisions/ (what a node could load)."""
    return sorted(str(p.relative_to(store.root)) for d in ("objects", "revisions") for p in (store.root / d).rglob("*"))
