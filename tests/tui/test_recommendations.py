"""What fits a host: the node screen's `w` opens llmfit's recommendations for the node's host, which the real
daemon gets by running the real llmfit on a loopback SSH host; the rows, the catalog marks and the refusals."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from textual.widgets import Input, Static

from qiip_core.recommendations import parse_recommendations
from qiip_tui import QiipConsole
from qiip_tui._recommendations import RECOMMENDATION_COLUMNS, catalog_mark, hardware_line, host_of, recommendation_rows
from qiip_tui.screens import NodeScreen, RecommendationsScreen
from qiip_tui.widgets import ConsoleTable
from tests.support.daemon import Daemon
from tests.support.sshd import SshHosts
from tests.tui.conftest import config_for, screen_of, wait_for
from tests.tui.fakes import FakeClient
from tests.tui.samples import LLMFIT_OUTPUT, node, sample_fleet

GPU_PROFILE = "apple-m3-max-128gb"
"""A bundled llmfit hardware profile with a GPU, standing in for a GPU host."""


def status_of(screen: RecommendationsScreen) -> str:
    return str(screen.query_one("#recommendations-status", Static).render())


def test_rows_follow_llmfits_ranking_and_mark_the_catalog() -> None:
    found = parse_recommendations(LLMFIT_OUTPUT.read_text(), host="gpu01", profile=GPU_PROFILE)
    held = found.recommendations[4]
    assert held.gguf_sources, "the fixture's fifth model names GGUF repositories"
    marked = found.model_copy(
        update={
            "recommendations": (
                found.recommendations[0].model_copy(update={"in_catalog": True}),
                *found.recommendations[1:4],
                held.model_copy(
                    update={"gguf_sources": (held.gguf_sources[0].model_copy(update={"in_catalog": True}),)}
                ),
            )
        }
    )
    rows = recommendation_rows(marked)
    assert [row[0] for row in rows] == ["1", "2", "3", "4", "5"]
    assert all(len(row) == len(RECOMMENDATION_COLUMNS) for row in rows)
    first = dict(zip(RECOMMENDATION_COLUMNS, rows[0], strict=True))
    assert first["Model"] == "mattbucci/gemma-4-12B-AWQ" and first["Runtime"] == "vLLM"
    assert first["Memory"] == "9.5 GiB" and first["Catalog"] == "in catalog"
    second = marked.recommendations[1]
    assert rows[1][2] == "llama.cpp" and rows[1][6] == "—"
    assert rows[1][7] == ("no GGUF source" if second.lacks_gguf else "")
    assert catalog_mark(marked.recommendations[4]) == "GGUF in catalog"
    # A llama.cpp model with no GGUF to serve it from is flagged; one whose repository is a GGUF one is not.
    bare = second.model_copy(update={"runtime": "llama_cpp", "gguf_sources": (), "repo": "org/model"})
    assert catalog_mark(bare) == "no GGUF source"
    assert catalog_mark(bare.model_copy(update={"repo": "org/model-GGUF"})) == ""
    assert catalog_mark(bare.model_copy(update={"runtime": "vllm"})) == ""
    line = hardware_line(marked)
    assert line.startswith(f"Profile {GPU_PROFILE} · ") and "RAM 115/128 GiB unified" in line
    assert "1 × User-specified GPU, VRAM 128 GiB" in line and line.endswith("llmfit 1.1.17")


def test_the_host_of_a_node_is_its_endpoints() -> None:
    assert host_of(node("n", endpoint="http://10.0.0.5:8000")) == "10.0.0.5"
    assert host_of(node("n", endpoint="http://[::1]:8000")) == "::1"
    assert host_of(node("n", endpoint="http://gpu01.lab:8000")) == "gpu01.lab"


async def test_a_daemon_without_the_api_is_named() -> None:
    app = QiipConsole(client=FakeClient(sample_fleet()), metrics_interval_s=3600, node_poll_s=3600)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(pilot, lambda: "gpu02" in app.fleet.nodes, what="the fleet")
        app.push_screen(NodeScreen("gpu02"))
        await screen_of(pilot, NodeScreen)
        await pilot.press("w")
        screen = await screen_of(pilot, RecommendationsScreen)
        await wait_for(pilot, lambda: "no recommendations API" in status_of(screen), what="the refusal")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    with SshHosts(tmp_path_factory.mktemp("fits-ssh"), 1, family="debian", gpu=False, first=60) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, hosts: SshHosts) -> Iterator[Daemon]:
    env = {
        "QIIP_PROVISIONING__SSH_PORT": str(hosts.port),
        "QIIP_PROVISIONING__SSH_KEY_FILE": str(hosts.client_key),
        "QIIP_PROVISIONING__KNOWN_HOSTS_FILE": str(hosts.known_hosts),
        "QIIP_PROVISIONING__LLMFIT_TIMEOUT_S": "120",
    }
    with Daemon(tmp_path_factory.mktemp("fits-daemon"), env=env) as daemon:
        yield daemon


@pytest.mark.integration
async def test_w_shows_what_fits_the_nodes_host(daemon: Daemon, hosts: SshHosts) -> None:
    host = hosts[0].address
    # A node on that host; nothing listens on its port, which does not matter to llmfit.
    daemon.add_node("lab-gpu", f"http://{host}:9", "m", wait=False)
    app = QiipConsole(config_for(daemon))
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: "lab-gpu" in app.fleet.nodes, what="the node")
        app.push_screen(NodeScreen("lab-gpu"))
        await screen_of(pilot, NodeScreen)
        await pilot.press("w")
        screen = await screen_of(pilot, RecommendationsScreen)
        assert screen.host == host
        # The host's own hardware first (this machine: no GPU).
        await wait_for(
            pilot, lambda: screen.found is not None or "No " in status_of(screen), timeout_s=150, what="llmfit"
        )
        assert screen.found is not None and screen.found.profile is None, status_of(screen)
        assert status_of(screen).startswith(f"Host {host} · ") and "no GPU" in status_of(screen)

        # A GPU profile typed after `/`: ranked rows, every column filled.
        await pilot.press("slash", *GPU_PROFILE, "enter")
        await wait_for(
            pilot,
            lambda: screen.found is not None and screen.found.profile == GPU_PROFILE,
            timeout_s=150,
            what="the profile's answer",
        )
        table: ConsoleTable[Any] = screen.query_one("#recommendations", ConsoleTable)
        assert table.row_count == len(screen.found.recommendations) > 0
        assert [str(c) for c in table.get_row_at(0)][:2] == ["1", screen.found.recommendations[0].repo]
        assert status_of(screen).startswith(f"Profile {GPU_PROFILE} · ")

        # An unknown profile: llmfit's reason, and the last answer stays on the screen.
        await pilot.press("slash")
        screen.query_one("#profile", Input).value = "no-such-profile"
        await pilot.press("enter")
        await wait_for(pilot, lambda: "No recommendations" in status_of(screen), timeout_s=150, what="the refusal")
        assert "profile no-such-profile" in status_of(screen) and table.row_count > 0
