"""`/admin/models/*` against the running daemon: the catalog of a real cache, downloads from a loopback hub."""

from __future__ import annotations

import hashlib
import os
import shutil
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
from click.testing import CliRunner

from qiip_cli._main import cli
from tests.support.daemon import Daemon, wait_until
from tests.support.fake_hub import FakeHub, FileServer
from tests.support.model_cache import GEMMA_REPO, ModelCache

pytestmark = pytest.mark.integration

REPO = "qiip-test/tiny-GGUF"
COMMIT = "d" * 40


@pytest.fixture(scope="module")
def hub(model_cache: ModelCache) -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.add(REPO, COMMIT, {"tiny-F16.gguf": model_cache.tiny}, refs=("main", "v2"))
    with fake.running():
        yield fake


@pytest.fixture(scope="module")
def models_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: ModelCache, hub: FakeHub) -> Iterator[Daemon]:
    # A copy of the shared cache (blobs hard-linked), since downloads add to it.
    cache = tmp_path_factory.mktemp("hf") / "hub"
    shutil.copytree(model_cache.root, cache, symlinks=True, copy_function=os.link)
    # The daemon downloads from the loopback hub only: offline mode off, the endpoint the fake.
    env = {
        "QIIP_MODELS__HF_CACHE_DIR": str(cache),
        "QIIP_MODELS__HUB_ENDPOINT": hub.endpoint,
        "HF_HUB_OFFLINE": "0",
        "HF_ENDPOINT": hub.endpoint,
    }
    with Daemon(tmp_path_factory.mktemp("models-daemon"), env=env) as daemon:
        yield daemon


def test_the_catalog_lists_generations_and_counts_issues(models_daemon: Daemon) -> None:
    answer = models_daemon.admin.get("/admin/models/catalog")
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-qiip-catalog-degraded"] == "false"
    body = answer.json()
    assert body["counters"] == {"incomplete": 2, "unverifiable": 1, "invalid": 1, "corrupted": 0}
    gemma = next(g for g in body["gguf"] if g["repo_id"] == GEMMA_REPO)
    assert gemma["quantization"] == "Q4_K_M" and gemma["modelled"] and gemma["nodes"] == []
    assert [m["repo_id"] for m in body["full"]] == ["qiip-test/tiny-safetensors"]


def test_a_degraded_cache_is_flagged(tmp_path: Path, model_cache: ModelCache) -> None:
    from tests.support.hf_cache import HfCacheBuilder

    cache = HfCacheBuilder(tmp_path / "hub")
    cache.add_file("bad/model", "a" * 40, "m.gguf", source=model_cache.tiny)
    cache.set_ref("bad/model", "main", "b" * 40)
    with Daemon(tmp_path / "state", env={"QIIP_MODELS__HF_CACHE_DIR": str(cache.root)}) as daemon:
        answer = daemon.admin.get("/admin/models/catalog")
    assert answer.headers["x-qiip-catalog-degraded"] == "true" and answer.json()["degraded"]


def test_a_download_is_tracked_and_lands_in_the_catalog(models_daemon: Daemon) -> None:
    admin = models_daemon.admin
    started = admin.post("/admin/models/download", json={"repo_id": REPO, "revision": "v2"})
    assert started.status_code == 202, started.text
    download = started.json()
    joined = admin.post("/admin/models/download", json={"repo_id": REPO, "revision": "v2"}).json()
    assert joined["id"] == download["id"] or joined["state"] != "running" or download["state"] != "running"

    def finished() -> bool:
        return bool(admin.get(f"/admin/models/downloads/{download['id']}").json()["state"] != "running")

    wait_until(finished, timeout_s=60, what="the download to finish")
    done = admin.get(f"/admin/models/downloads/{download['id']}").json()
    assert done["state"] == "succeeded", done
    assert done["commit"] == COMMIT and done["bytes_done"] == done["bytes_total"] > 0
    assert download["id"] in [d["id"] for d in admin.get("/admin/models/downloads").json()["downloads"]]
    catalog = admin.get("/admin/models/catalog").json()
    assert any(g["revision"] == COMMIT and "v2" in g["refs"] for g in catalog["gguf"])


def test_model_status_lists_the_daemons_downloads(
    models_daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = models_daemon.admin
    download = admin.post("/admin/models/download", json={"repo_id": REPO, "revision": "main"}).json()
    wait_until(
        lambda: admin.get(f"/admin/models/downloads/{download['id']}").json()["state"] != "running",
        timeout_s=60,
        what="the download to finish",
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QIIP_CONFIG", raising=False)
    monkeypatch.setenv("QIIP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("QIIP_ADMIN__USERNAME", models_daemon.env["QIIP_ADMIN__USERNAME"])
    monkeypatch.setenv("QIIP_ADMIN__PASSWORD", models_daemon.env["QIIP_ADMIN__PASSWORD"])
    listed = CliRunner().invoke(cli, ["model", "status", "--url", models_daemon.url])
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[0].startswith("no registered revisions")
    assert lines[1] == f"hub downloads in the daemon at {models_daemon.url}:"
    (line,) = [entry for entry in lines[2:] if download["id"] in entry]
    assert f"{REPO}@main -> {COMMIT[:12]}  succeeded  " in line and "(100%)" in line
    monkeypatch.setenv("QIIP_ADMIN__PASSWORD", "wrong")
    refused = CliRunner().invoke(cli, ["model", "status", "--url", models_daemon.url])
    assert refused.exit_code == 0 and refused.output.splitlines()[1].startswith("hub downloads: not listed: ")


@pytest.mark.parametrize(
    "body",
    [
        {"repo_id": "no-slash"},
        {"repo_id": "a/b", "sneaky": 1},
        {"repo_id": "a/b", "revision": "bad rev"},
        {"repo_id": "a/b", "revision": "main/../../../../../tmp/x"},
        {"repo_id": "a/b", "files": ["../../escape.gguf"]},
    ],
)
def test_bad_download_requests_are_refused(models_daemon: Daemon, body: dict[str, object]) -> None:
    answer = models_daemon.admin.post("/admin/models/download", json=body)
    assert answer.status_code == 422, answer.text
    assert not any(
        d["repo_id"] == "a/b" for d in models_daemon.admin.get("/admin/models/downloads").json()["downloads"]
    )
    assert models_daemon.admin.get("/admin/models/downloads/dl_nope").status_code == 404


def test_a_failed_download_says_why(models_daemon: Daemon) -> None:
    admin = models_daemon.admin
    download = admin.post("/admin/models/download", json={"repo_id": "qiip-test/absent"}).json()
    wait_until(lambda: admin.get(f"/admin/models/downloads/{download['id']}").json()["state"] != "running", 30)
    failed = admin.get(f"/admin/models/downloads/{download['id']}").json()
    assert failed["state"] == "failed" and "no repository qiip-test/absent" in failed["error"]
    assert httpx.get(models_daemon.url + "/admin/models/catalog", timeout=10).status_code == 401


@pytest.fixture(scope="module")
def https_source(
    tmp_path_factory: pytest.TempPathFactory, model_cache: ModelCache
) -> Iterator[tuple[FileServer, Path]]:
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    bundle = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    server = FileServer(context)
    server.files["/tiny.gguf"] = model_cache.tiny
    with server.running():
        yield server, bundle


def test_a_manifest_is_registered_acquired_and_verified(
    tmp_path: Path, model_cache: ModelCache, https_source: tuple[FileServer, Path]
) -> None:
    server, bundle = https_source
    env = {"QIIP_MODELS__CA_BUNDLE": str(bundle), "QIIP_MODELS__ALLOWED_DOWNLOAD_HOSTS": '["127.0.0.1"]'}
    digest = hashlib.sha256(model_cache.tiny.read_bytes()).hexdigest()
    manifest: dict[str, Any] = {
        "name": "Tiny",
        "revision": "1" * 40,
        "source": "qiip-test/tiny",
        "licence": "Apache-2.0",
        "format": "gguf",
        "quantization": "F16",
        "entrypoint": "tiny.gguf",
        "files": [
            {
                "name": "tiny.gguf",
                "digest": f"sha256:{digest}",
                "bytes": model_cache.tiny.stat().st_size,
                "url": server.url + "/tiny.gguf",
            }
        ],
    }
    with Daemon(tmp_path / "state", env=env) as daemon:
        admin = daemon.admin
        created = admin.post("/admin/models/manifests", json=manifest)
        assert created.status_code == 201, created.text
        revision = created.json()
        assert revision["state"] == "registered" and revision["bytes_total"] == manifest["files"][0]["bytes"]
        assert admin.post("/admin/models/manifests", json=manifest).status_code == 200
        started = admin.post(f"/admin/models/manifests/{revision['id']}/acquire", json={})
        assert started.status_code == 202, started.text

        def available() -> bool:
            return bool(admin.get(f"/admin/models/manifests/{revision['id']}").json()["state"] == "available")

        wait_until(available, timeout_s=30, what="the acquisition")
        listed = admin.get("/admin/models/manifests").json()["revisions"]
        assert [r["artifact_id"] for r in listed] == [revision["artifact_id"]]
        assert admin.post(f"/admin/models/manifests/{revision['id']}/verify", json={}).json()["ok"]
        bad = admin.post("/admin/models/manifests", json=manifest | {"entrypoint": "x.gguf", "revision": "2" * 40})
        assert bad.status_code == 422 and bad.json()["error"]["violations"][0]["field"] == "entrypoint"
        assert admin.get("/admin/models/manifests/rev_nope").json()["error"]["code"] == "revision_not_found"
