"""The models screen: its pure parts, and the screen against a real daemon over a real hub cache."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.widgets import DataTable, Static

from qiip_tui import QiipConsole
from qiip_tui._models import catalog_rows, catalog_summary, download_line, size_text
from qiip_tui.screens import MODELS_NOT_AVAILABLE, ModelsScreen
from tests.support.daemon import Daemon
from tests.support.model_cache import GEMMA_REPO, ModelCache
from tests.tui.conftest import config_for, screen_of, wait_for
from tests.tui.fakes import SAMPLE_CATALOG, SAMPLE_DOWNLOADS, FakeClient, sample_fleet


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
