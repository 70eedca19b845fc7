"""The models screen: its pure parts, and the screen against a real daemon over a real hub cache."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, Static

from qiip_tui import QiipConsole
from qiip_tui._models import catalog_rows, catalog_summary, download_line, size_text
from qiip_tui.screens import MODELS_NOT_AVAILABLE, ConfirmModal, DownloadModal, ModelsScreen
from tests.support.daemon import Daemon
from tests.support.fake_hub import FakeHub
from tests.support.model_cache import GEMMA_REPO, TINY_REPO, ModelCache
from tests.tui.conftest import config_for, screen_of, wait_for
from tests.tui.fakes import FakeClient
from tests.tui.samples import SAMPLE_CATALOG, SAMPLE_DOWNLOADS, sample_fleet


def test_rows_summary_and_download_lines() -> None:
    rows = catalog_rows(SAMPLE_CATALOG)
    assert rows[0][1] == (
        "5d1f5d1f5d1f",
        GEMMA_REPO,
        "0123456789ab (main)",
        "gemma-3-270m-q4_k_m.gguf",
        "gemma3",
        "Q4_K_M",
        "32,768",
        "241.4 MiB",
        "gpu01, gpu02",
    )
    assert rows[1][1][3].endswith(" *") and rows[1][1][8] == "-"
    text, degraded = catalog_summary(SAMPLE_CATALOG)
    assert degraded and text.startswith("DEGRADED") and "1 incomplete, 1 corrupted" in text
    assert download_line(SAMPLE_DOWNLOADS[0]) == (
        "Qwen/Qwen3-8B-GGUF@main  running  1.9 GiB of 4.7 GiB  100.0 MiB/s  ETA 29 s"
    )
    assert download_line(SAMPLE_DOWNLOADS[1]).endswith("(or it is private).")
    assert (size_text(None), size_text(812)) == ("?", "812 B")


async def test_a_daemon_without_the_models_api_is_said_so() -> None:
    app = QiipConsole(client=FakeClient(sample_fleet()), metrics_interval_s=3600)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("m")
        screen = await screen_of(pilot, ModelsScreen)
        assert str(screen.query_one("#models-summary", Static).render()) == MODELS_NOT_AVAILABLE


@pytest.fixture(scope="module")
def models_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: ModelCache) -> Iterator[Daemon]:
    cache = tmp_path_factory.mktemp("hf") / "hub"
    shutil.copytree(model_cache.root, cache, symlinks=True, copy_function=_link)
    with Daemon(tmp_path_factory.mktemp("state"), env={"QIIP_MODELS__HF_CACHE_DIR": str(cache)}) as daemon:
        yield daemon


def _link(source: str, target: str) -> None:
    Path(target).hardlink_to(source)


@pytest.mark.integration
async def test_the_screen_lists_the_daemons_generations(models_daemon: Daemon) -> None:
    app = QiipConsole(config_for(models_daemon))
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("m")
        screen = await screen_of(pilot, ModelsScreen)
        table = screen.query_one("#generations", DataTable)
        await wait_for(pilot, lambda: table.row_count == 6, what="the six generations")
        summary = str(screen.query_one("#models-summary", Static).render())
        assert "2 incomplete, 1 unverifiable, 1 invalid" in summary and not summary.startswith("DEGRADED")
        assert any(GEMMA_REPO in str(table.get_row_at(i)[1]) for i in range(table.row_count))
        await pilot.press("r", "q")


@pytest.fixture(scope="module")
def hub(model_cache: ModelCache) -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.add(TINY_REPO, "d" * 40, {"tiny-F16.gguf": model_cache.tiny}, refs=("main", "v2"))
    with fake.running():
        yield fake


@pytest.fixture(scope="module")
def download_daemon(tmp_path_factory: pytest.TempPathFactory, hub: FakeHub) -> Iterator[Daemon]:
    """A daemon with an empty cache that downloads from the loopback hub only."""
    env = {
        "QIIP_MODELS__HF_CACHE_DIR": str(tmp_path_factory.mktemp("hf-empty") / "hub"),
        "QIIP_MODELS__HUB_ENDPOINT": hub.endpoint,
        "HF_HUB_OFFLINE": "0",
        "HF_ENDPOINT": hub.endpoint,
    }
    with Daemon(tmp_path_factory.mktemp("download-state"), env=env) as daemon:
        yield daemon


async def _ask(pilot: Pilot[Any], repo_id: str, revision: str) -> None:
    await pilot.press("d")
    modal = await screen_of(pilot, DownloadModal)
    modal.query_one("#repo-id", Input).value = repo_id
    modal.query_one("#revision", Input).value = revision
    await pilot.press("enter")
    await screen_of(pilot, ConfirmModal)


@pytest.mark.integration
async def test_a_download_is_asked_confirmed_and_followed(download_daemon: Daemon) -> None:
    app = QiipConsole(config_for(download_daemon))
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("m")
        screen = await screen_of(pilot, ModelsScreen)
        # Cancelled at either step, nothing starts.
        await pilot.press("d")
        await screen_of(pilot, DownloadModal)
        await pilot.press("escape")
        await screen_of(pilot, ModelsScreen)
        await _ask(pilot, TINY_REPO, "v2")
        await pilot.press("n")
        await screen_of(pilot, ModelsScreen)
        assert download_daemon.admin.get("/admin/models/downloads").json()["downloads"] == []

        await _ask(pilot, TINY_REPO, "v2")
        await pilot.press("y")
        await screen_of(pilot, ModelsScreen)
        await wait_for(pilot, lambda: len(screen.query(".download")) == 1, what="the download's row")
        (download,) = download_daemon.admin.get("/admin/models/downloads").json()["downloads"]
        assert (download["repo_id"], download["revision"]) == (TINY_REPO, "v2")
        assert any(n.message.startswith(f"Downloading {TINY_REPO}@v2") for n in app._notifications)
        table = screen.query_one("#generations", DataTable)
        await wait_for(pilot, lambda: table.row_count == 1, what="the downloaded generation")

        # A name the daemon refuses: one line, and the screen stays.
        await _ask(pilot, "no-slash", "")
        await pilot.press("y")
        await wait_for(
            pilot, lambda: any(n.title == "Download refused" for n in app._notifications), what="the refusal"
        )
        (refusal,) = [n for n in app._notifications if n.title == "Download refused"]
        assert refusal.severity == "error" and "\n" not in refusal.message
        assert refusal.message.startswith("no-slash: repo_id: ")
        assert len(download_daemon.admin.get("/admin/models/downloads").json()["downloads"]) == 1
        await screen_of(pilot, ModelsScreen)
