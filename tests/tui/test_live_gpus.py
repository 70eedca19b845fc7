"""Live GPUs in the console: `qiip agent` (the real pynvml over the stub NVML library) publishes into a real etcd,
the real daemon serves the readings, and the fleet table's GPU column and the node screen's meters show them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from textual.widgets import Label

from qiip_core.client import NodeInfo
from qiip_tui import QiipConsole
from qiip_tui._fleet import gpu_totals, live_readings, shown_devices
from qiip_tui.screens import NodeScreen
from qiip_tui.widgets import FleetTable, GpuMeter
from tests.support.agent import Agent
from tests.support.daemon import Daemon, free_port, wait_until
from tests.support.etcd import EtcdServer
from tests.support.nvml_stub import STUB_GPUS
from tests.tui.conftest import config_for, screen_of, wait_for
from tests.tui.samples import node, runtime

INTERVAL = {"QIIP_TELEMETRY__INTERVAL_S": "0.5"}


def live(*, stale: bool = False) -> dict[str, object]:
    return {"read_at": "2026-11-29T12:00:00Z", "age_s": 1.0, "stale": stale, "interval_s": 1.0, "gpus": STUB_GPUS}


def test_live_readings_come_first_and_stale_ones_do_not_count() -> None:
    recorded = node("gpu01", llamacpp_runtime=runtime(gpus=((61000, 81920),)))
    assert gpu_totals(recorded) == (61000, 81920) and live_readings(recorded) == []
    fresh = NodeInfo.model_validate({**recorded.model_dump(), "gpus_live": live()})
    assert gpu_totals(fresh) == (20480, 81920 + 23034)
    assert [(d.index, d.used_mib, d.total_mib) for d in shown_devices(fresh)] == [(0, 20480, 81920), (1, 0, 23034)]
    stale = NodeInfo.model_validate({**recorded.model_dump(), "gpus_live": live(stale=True)})
    assert gpu_totals(stale) == (61000, 81920) and [d.used_mib for d in shown_devices(stale)] == [61000]


@pytest.mark.integration
async def test_the_console_shows_an_agents_live_gpus(etcd: EtcdServer, nvml_stub: Path, tmp_path: Path) -> None:
    env = {"QIIP_REGISTRY__BACKEND": "etcd", "QIIP_ETCD__ENDPOINTS": json.dumps([etcd.url])} | INTERVAL
    with Daemon(tmp_path / "gateway", env=env) as daemon:
        body = {"id": "gpu-node-1", "endpoint": f"http://127.0.0.1:{free_port()}", "model": "m"}
        assert daemon.admin.post("/admin/nodes", json=body).status_code == 201
        agent_env = env | {"LD_LIBRARY_PATH": str(nvml_stub)}
        with Agent(tmp_path / "agent", env=agent_env, args=("--node-id", "gpu-node-1")):
            wait_until(
                lambda: daemon.admin.get("/admin/nodes/gpu-node-1").json().get("gpus_live") is not None,
                what="a reading",
            )
            app = QiipConsole(config_for(daemon), metrics_interval_s=0.5, node_poll_s=0.5)
            async with app.run_test(size=(160, 48)) as pilot:
                table = app.screen.query_one(FleetTable)
                await wait_for(
                    pilot,
                    lambda: "gpu-node-1" in app.fleet.nodes and app.fleet.nodes["gpu-node-1"].gpus_live is not None,
                    timeout_s=20,
                    what="the live reading",
                )
                await pilot.pause()
                gpu_cell = str(table.get_cell("gpu-node-1", "gpu"))
                assert gpu_cell.endswith(" 20/102G"), gpu_cell

                app.push_screen(NodeScreen("gpu-node-1"))
                screen = await screen_of(pilot, NodeScreen)
                await wait_for(pilot, lambda: len(screen.query(GpuMeter)) == 2, what="two meters")
                label = str(screen.query_one("#devices-label", Label).render())
                assert label.startswith("Devices · live "), label
                assert str(screen.query_one("#gpu-0 .gpu-figures", Label).render()) == "20.0G / 80.0G"
                assert str(screen.query_one("#gpu-0 .gpu-detail", Label).render()) == "37% · 45°C · 250W"
                # The second GPU does not report its power: nothing is made up.
                assert str(screen.query_one("#gpu-1 .gpu-figures", Label).render()) == "0M / 22.5G"
                assert str(screen.query_one("#gpu-1 .gpu-detail", Label).render()) == "0% · 31°C"
