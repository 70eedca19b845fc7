"""Downloads through huggingface_hub's own machinery from a loopback hub that answers with the hub's headers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from qiip_core import DownloadFailed
from qiip_core.catalog import Download, DownloadManager, DownloadState, download_files, scan_catalog
from qiip_core.config import ModelSettings
from tests.support.fake_hub import FakeHub
from tests.support.model_cache import ModelCache

REPO = "qiip-test/tiny-GGUF"
COMMIT = "c0ffee" + "0" * 34


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, model_cache: ModelCache) -> Iterator[FakeHub]:
    readme = tmp_path_factory.mktemp("repo") / "README.md"
    readme.write_text("# tiny\n")
    fake = FakeHub()
    fake.add(REPO, COMMIT, {"tiny-F16.gguf": model_cache.tiny, "README.md": readme})
    split = {f"split/{p.name}": p for p in model_cache.split}
    fake.add("qiip-test/split-GGUF", "5" * 40, split)
    fake.renamed["qiip-test/old-name-GGUF"] = REPO
    with fake.running():
        yield fake


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub out of offline mode, for this test only (the endpoint is the loopback hub's)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def _download(repo: str, revision: str = "main", files: tuple[str, ...] = ()) -> Download:
    return Download(id="dl_test", repo_id=repo, revision=revision, files=files)


def test_a_branch_is_resolved_to_its_commit_and_recorded(tmp_path: Path, hub: FakeHub, online: None) -> None:
    cache = tmp_path / "hub"
    download = _download(REPO)
    download_files(download, settings=ModelSettings(hub_endpoint=hub.endpoint), cache_dir=cache)
    assert download.commit == COMMIT
    assert download.resolved_files == ("README.md", "tiny-F16.gguf")
    assert download.bytes_total is not None and download.bytes_done == download.bytes_total > 0
    assert (cache / "models--qiip-test--tiny-GGUF" / "refs" / "main").read_text() == COMMIT
    catalog = scan_catalog(cache)
    (generation,) = catalog.gguf
    assert (generation.revision, generation.refs, generation.verifiable) == (COMMIT, ("main",), True)
    assert generation.entrypoint_path.read_bytes() == hub.blobs[generation.blobs[0].name].read_bytes()
    # The large file came from the storage host through the hub's redirect; nothing partial is left.
    assert any(path.startswith("/blobs/") for _, path, _ in hub.requests)
    assert not list(cache.rglob("*.incomplete"))


def test_a_renamed_repository_is_followed_through_the_hubs_redirects(
    tmp_path: Path, hub: FakeHub, online: None
) -> None:
    download = _download("qiip-test/old-name-GGUF", files=("tiny-F16.gguf",))
    download_files(download, settings=ModelSettings(hub_endpoint=hub.endpoint), cache_dir=tmp_path)
    assert download.commit == COMMIT
    assert any(path.startswith("/qiip-test/old-name-GGUF/resolve/") for _, path, _ in hub.requests)
    (generation,) = scan_catalog(tmp_path).gguf
    assert generation.repo_id == "qiip-test/old-name-GGUF" and generation.revision == COMMIT


def test_a_dropped_transfer_resumes_with_range_within_the_download(tmp_path: Path, hub: FakeHub, online: None) -> None:
    from huggingface_hub import constants

    # huggingface_hub keeps what it received in whole chunks (DOWNLOAD_CHUNK_SIZE, 10 MiB): a file of 2.4 chunks,
    # cut after 1.5, resumes at the end of the first.
    big = tmp_path / "big.gguf"
    big.write_bytes(os.urandom(int(2.4 * constants.DOWNLOAD_CHUNK_SIZE)))
    hub.add("qiip-test/big-GGUF", "b1" * 20, {"big.gguf": big})
    hub.drop_blob_at = int(1.5 * constants.DOWNLOAD_CHUNK_SIZE)
    before = len(hub.requests)
    download = _download("qiip-test/big-GGUF")
    download_files(download, settings=ModelSettings(hub_endpoint=hub.endpoint), cache_dir=tmp_path / "hub")
    fetched = [r[2] for r in hub.requests[before:] if r[0] == "GET" and r[1].startswith("/blobs/")]
    assert fetched == [None, f"bytes={constants.DOWNLOAD_CHUNK_SIZE}-"]
    snapshot = tmp_path / "hub" / "models--qiip-test--big-GGUF" / "snapshots" / ("b1" * 20)
    assert (snapshot / "big.gguf").read_bytes() == big.read_bytes()
    assert download.bytes_done == download.bytes_total == big.stat().st_size


def test_a_split_family_downloads_whole(tmp_path: Path, hub: FakeHub, online: None) -> None:
    download = _download("qiip-test/split-GGUF")
    download_files(download, settings=ModelSettings(hub_endpoint=hub.endpoint), cache_dir=tmp_path)
    (generation,) = scan_catalog(tmp_path).gguf
    assert generation.entrypoint == "split/tiny-split-00001-of-00003.gguf" and len(generation.files) == 3


@pytest.mark.parametrize(
    ("repo", "revision", "files", "reason"),
    [
        ("qiip-test/absent", "main", (), "no repository qiip-test/absent"),
        (REPO, "v9", (), "no revision 'v9'"),
        (REPO, "main", ("nope.gguf",), "has no file nope.gguf"),
    ],
)
def test_refusals_name_the_thing(
    tmp_path: Path, hub: FakeHub, online: None, repo: str, revision: str, files: tuple[str, ...], reason: str
) -> None:
    with pytest.raises(DownloadFailed) as info:
        download_files(
            _download(repo, revision, files), settings=ModelSettings(hub_endpoint=hub.endpoint), cache_dir=tmp_path
        )
    assert reason in info.value.message
    assert not (tmp_path / "models--qiip-test--tiny-GGUF" / "snapshots").exists()


def test_offline_mode_is_refused(tmp_path: Path, hub: FakeHub) -> None:
    with pytest.raises(DownloadFailed, match="offline"):
        download_files(_download(REPO), settings=ModelSettings(hub_endpoint=hub.endpoint), cache_dir=tmp_path)


async def test_the_same_request_joins_the_running_download(tmp_path: Path, hub: FakeHub, online: None) -> None:
    manager = DownloadManager(ModelSettings(hub_endpoint=hub.endpoint), tmp_path)
    first = manager.start(REPO, files=["tiny-F16.gguf"])
    assert manager.start(REPO, revision="main", files=["tiny-F16.gguf"]) is first
    other = manager.start(REPO, files=["README.md"])
    assert other is not first
    await manager.wait(first)
    await manager.wait(other)
    assert first.state is DownloadState.SUCCEEDED and first.view()["eta_s"] == 0.0, first.error
    assert other.state is DownloadState.SUCCEEDED, other.error
    again = manager.start(REPO, files=["tiny-F16.gguf"])
    assert again is not first
    await manager.wait(again)
    assert again.state is DownloadState.SUCCEEDED
    assert [d.id for d in manager.list()] == [again.id, other.id, first.id]
    await manager.aclose()


@pytest.mark.parametrize(
    ("revision", "reason"),
    [
        ("main/../../../../../escape", "a component starts with '.'"),
        ("../refs", "a component starts with '.'"),
        ("/etc/passwd", "empty path component"),
        ("v1//x", "empty path component"),
        ("main.lock", "ends with '.lock'"),
        ("main\nx", "is not a branch, tag or commit"),
    ],
)
def test_a_revision_that_is_not_a_ref_name_is_refused_before_any_request(
    tmp_path: Path, hub: FakeHub, online: None, revision: str, reason: str
) -> None:
    before = len(hub.requests)
    with pytest.raises(DownloadFailed, match="is refused") as info:
        download_files(
            _download(REPO, revision), settings=ModelSettings(hub_endpoint=hub.endpoint), cache_dir=tmp_path / "hub"
        )
    assert reason in info.value.message
    assert len(hub.requests) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_paths_a_hostile_hub_names_are_refused(tmp_path: Path, hub: FakeHub, online: None) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# hostile\n")
    hub.add("qiip-test/escape-name-GGUF", "e5" * 20, {"../../../../escaped.md": readme})
    hub.add("qiip-test/escape-commit-GGUF", "../../../../outside", {"README.md": readme})
    cache = tmp_path / "hub"
    with pytest.raises(
        DownloadFailed, match="listed a file .* that cannot be stored: file name '../../../../escaped.md'"
    ):
        download_files(
            _download("qiip-test/escape-name-GGUF"), settings=ModelSettings(hub_endpoint=hub.endpoint), cache_dir=cache
        )
    with pytest.raises(DownloadFailed, match="not 40 hexadecimal characters"):
        download_files(
            _download("qiip-test/escape-commit-GGUF"),
            settings=ModelSettings(hub_endpoint=hub.endpoint),
            cache_dir=cache,
        )
    assert not list(tmp_path.rglob("escaped.md")) and not (tmp_path / "outside").exists()
