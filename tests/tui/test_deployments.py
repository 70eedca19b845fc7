"""The deployments screen: its pure parts, the screen driven with the core's own deployment records, and the screen
against a real daemon holding a deployment no host of its pool can take."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, Label, Static

from qiip_core.catalog import scan_catalog
from qiip_core.client import ApiError
from qiip_tui import QiipConsole
from qiip_tui._deployments import (
    autoscale_line,
    conditions_line,
    deployment_rows,
    event_record,
    replica_rows,
    summary_line,
)
from qiip_tui.screens import DEPLOYMENTS_NOT_AVAILABLE, ConfirmModal, DeploymentsScreen, ScaleModal
from qiip_tui.widgets import LogView, TargetSparkline
from qiip_tui.widgets._target_sparkline import target_bars
from tests.support.daemon import Daemon
from tests.support.hf_cache import HfCacheBuilder
from tests.tui.conftest import config_for, screen_of, wait_for
from tests.tui.deployment_samples import sample_deployments
from tests.tui.fakes import FakeClient, FakeDeploymentsClient
from tests.tui.samples import sample_fleet


def test_rows_and_lines_say_what_the_cli_says() -> None:
    big, coder, embed = sample_deployments()
    rows = dict(deployment_rows([big, coder, embed]))
    assert rows["coder"][:7] == ("coder", "llama_cpp", "3/3", "3", "4", "Available", "active → 4")
    assert rows["embed"][2:6] == ("1/2", "2", "3 (observed 2)", "ReplicasStarting")
    assert rows["big"][5:7] == ("NoFittingHost", "—")
    assert summary_line([big, coder, embed]) == (
        "3 deployments, 1 available; big NoFittingHost, embed ReplicasStarting."
    )
    assert conditions_line(big).splitlines()[1:] == [
        "Available MinimumReplicasUnavailable: 0 of 1 ready",
        "Degraded NoFittingHost: No host of the pool can take a replica (qiip deploy explain big says why for each).",
    ]
    assert conditions_line(coder).splitlines() == [
        f"coder: generation 4 (observed 4), 3/3 ready, 3 updated, template {coder['template']['hash']}"
    ]
    assert autoscale_line(coder) == (
        "autoscale active (1–4): in_flight_per_slot 1.26 (target 0.8) · 4 recommended "
        "(in_flight_per_slot 1.26 above 0.8 for 30 s)"
    )
    assert autoscale_line(embed) is None
    (ready, provisioning) = replica_rows(embed, {"cpu01": "healthy"})
    assert ready[1][:3] == ("cpu01", "healthy", "ready")
    assert provisioning[1][1:3] == ("—", "provisioning") and provisioning[1][5] == "step llama_cpp_install"
    failed = event_record(coder["status"]["events"][5])
    assert (failed.level, failed.tag, failed.source) == ("error", "failed", "gpu07")


def test_the_sparkline_draws_the_target_and_marks_what_is_above_it() -> None:
    rows = target_bars([0.2, 0.4, 1.6], 0.8, width=5, height=3)
    assert len(rows) == 3 and all(len(row) == 5 for row in rows)
    kinds = [[kind for _, kind in row] for row in rows]
    # The two missing samples leave blank columns on the left but for the target's rule; the newest is above it.
    assert kinds[2][2:] == ["below", "below", "above"] and kinds[0][4] == "above"
    assert [kind for kind in (r[0] for r in kinds) if kind] == ["target"]
    assert target_bars([], 1.0, width=0, height=3) == []


class _OldDaemon(FakeDeploymentsClient):
    """A daemon that predates deployments: `GET /admin/deployments` answers 404."""

    async def deployments(self) -> list[dict[str, Any]]:
        raise ApiError("Not Found", status=404, code=None, violations=[])


@pytest.mark.parametrize("kind", [FakeClient, _OldDaemon], ids=["client-without-the-api", "daemon-answers-404"])
async def test_a_daemon_without_the_deployments_api_is_said_so(kind: type[FakeClient]) -> None:
    app = QiipConsole(client=kind(sample_fleet()), metrics_interval_s=3600)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("a")
        screen = await screen_of(pilot, DeploymentsScreen)
        summary = screen.query_one("#deployments-summary", Static)
        await wait_for(pilot, lambda: str(summary.render()) == DEPLOYMENTS_NOT_AVAILABLE, what="the 404 said")


async def _opened(pilot: Pilot[Any]) -> DeploymentsScreen:
    await pilot.press("a")
    screen = await screen_of(pilot, DeploymentsScreen)
    await wait_for(pilot, lambda: screen.query_one("#deployments", DataTable).row_count == 3, what="the deployments")
    return screen


async def test_the_highlighted_deployment_shows_its_replicas_live_events_and_autoscaling() -> None:
    client = FakeDeploymentsClient(sample_fleet())
    app = QiipConsole(client=client, metrics_interval_s=3600)
    async with app.run_test(size=(160, 48)) as pilot:
        screen = await _opened(pilot)
        # `big` comes first: nothing placed, no autoscaling.
        assert screen.selected == "big" and screen.query_one("#replicas", DataTable).row_count == 0
        assert not screen.query_one("#autoscale-sparkline", TargetSparkline).display
        await pilot.press("down")
        await wait_for(pilot, lambda: screen.selected == "coder", what="coder highlighted")
        replicas = screen.query_one("#replicas", DataTable)
        assert [replicas.get_row_at(i)[1] for i in range(3)] == ["healthy", "healthy", "draining"]
        events = screen.query_one("#deployment-events", LogView)
        await wait_for(pilot, lambda: len(events.records) == 7, what="the kept events")
        client.push_event("coder", "scaled", "scaled from 3 to 4 replicas", host=None)
        await wait_for(pilot, lambda: len(events.records) == 8, what="the live event")
        sparkline = screen.query_one("#autoscale-sparkline", TargetSparkline)
        assert sparkline.display and sparkline.target == 0.8 and len(sparkline.values) == 16
        assert "4 recommended" in str(screen.query_one("#autoscale-line", Label).render())
        # Another deployment: its own events, followed once however often the list is polled.
        await pilot.press("down", "r")
        await wait_for(pilot, lambda: screen.selected == "embed" and not events.records, what="embed's events")
        assert client.followed == ["big", "coder", "embed"]


async def test_a_scale_is_asked_confirmed_and_a_refused_count_comes_back_as_typed() -> None:
    client = FakeDeploymentsClient(sample_fleet())
    app = QiipConsole(client=client, metrics_interval_s=3600)
    async with app.run_test(size=(120, 36)) as pilot:
        await _opened(pilot)
        await pilot.press("down", "s")
        modal = await screen_of(pilot, ScaleModal)
        field = modal.query_one("#replicas", Input)
        assert field.value == "3"
        field.value = "three"
        await pilot.press("enter")
        problem = modal.query_one("#scale-problem", Label)
        assert app.screen is modal and field.value == "three"
        assert (
            str(problem.render()) == "replicas: 'three' is not a whole number; type the count of replicas, such as 3."
        )
        field.value = "5000"
        await pilot.press("enter")
        await screen_of(pilot, ConfirmModal)
        await pilot.press("y")
        again = await screen_of(pilot, ScaleModal)
        refusal = "coder: replicas must be a whole number from 0 to 1000, got 5000."
        assert again.query_one("#replicas", Input).value == "5000"
        assert str(again.query_one("#scale-problem", Label).render()) == refusal
        assert any(n.message == refusal for n in app._notifications) and client.changes == []
        again.query_one("#replicas", Input).value = "4"
        await pilot.press("enter")
        await screen_of(pilot, ConfirmModal)
        await pilot.press("y")
        await wait_for(pilot, lambda: client.changes == [("scale", "coder", 4)], what="the scale sent")
        await wait_for(
            pilot, lambda: any(n.message == "coder: 4 replica(s) (generation 5)" for n in app._notifications)
        )


async def test_rollout_undo_and_delete_ask_first() -> None:
    client = FakeDeploymentsClient(sample_fleet())
    app = QiipConsole(client=client, metrics_interval_s=3600)
    async with app.run_test(size=(120, 36)) as pilot:
        screen = await _opened(pilot)
        # `big` has no earlier template: said at once, nothing asked.
        await pilot.press("u")
        await wait_for(pilot, lambda: any("no earlier template" in n.message for n in app._notifications))
        assert app.screen is screen
        await pilot.press("down", "u")
        modal = await screen_of(pilot, ConfirmModal)
        assert "back to template" in modal.body
        await pilot.press("n")
        await screen_of(pilot, DeploymentsScreen)
        await pilot.press("u")
        await screen_of(pilot, ConfirmModal)
        await pilot.press("y")
        await wait_for(pilot, lambda: client.changes == [("undo", "coder", None)], what="the undo sent")
        await pilot.press("x")
        modal = await screen_of(pilot, ConfirmModal)
        assert modal.question == "Delete coder?" and "3 replica(s) drain" in modal.body
        await pilot.press("y")
        await wait_for(pilot, lambda: client.changes[-1] == ("delete", "coder", None), what="the delete sent")


@pytest.fixture(scope="module")
def unplaceable(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Iterator[Daemon]:
    """A daemon whose pool cannot hold a replica (one host too small by the planner's numbers, one of unknown
    memory), holding the deployment `tiny` of the tiny model."""
    models = tmp_path_factory.mktemp("console-deploy-models")
    HfCacheBuilder(models).add_file("qiip-test/tiny-GGUF", "a" * 40, "tiny-Q8_0.gguf", source=tiny_gguf)
    (artifact,) = [g.artifact_id for g in scan_catalog(models).gguf]
    env = {
        "QIIP_PROVISIONING__PROFILE": "cpu",
        "QIIP_PROVISIONING__MODEL_CACHE_DIR": str(models),
        "QIIP_HOSTS": json.dumps([{"name": "cpu-small", "memory_mib": 32}, {"name": "cpu-unknown"}]),
        "QIIP_DEPLOYMENTS__RECONCILE_INTERVAL_S": "0.3",
    }
    with Daemon(tmp_path_factory.mktemp("console-deploy-state"), env=env) as daemon:
        spec = {
            "name": "tiny",
            "replicas": 1,
            "source": {"artifact": artifact},
            "runtime": {"capacity": {"sequences": 1, "context_tokens": 512}},
        }
        daemon.admin.put("/admin/deployments/tiny", json=spec).raise_for_status()
        yield daemon


@pytest.mark.integration
async def test_a_deployment_no_host_fits_is_listed_degraded_with_the_reason(unplaceable: Daemon) -> None:
    app = QiipConsole(config_for(unplaceable))
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("a")
        screen = await screen_of(pilot, DeploymentsScreen)
        table = screen.query_one("#deployments", DataTable)
        await wait_for(
            pilot,
            lambda: table.row_count == 1 and table.get_row_at(0)[5] == "NoFittingHost",
            timeout_s=30,
            what="tiny listed as NoFittingHost",
        )
        state = str(screen.query_one("#deployment-state", Static).render())
        assert "\nDegraded NoFittingHost: " in state
        events = screen.query_one("#deployment-events", LogView)
        await wait_for(pilot, lambda: any(r.tag == "unplaceable" for r in events.records), what="the unplaceable event")
        # The daemon's own refusal of a count, one line, and the dialog back with what was typed.
        await pilot.press("s")
        modal = await screen_of(pilot, ScaleModal)
        modal.query_one("#replicas", Input).value = "5000"
        await pilot.press("enter")
        await screen_of(pilot, ConfirmModal)
        await pilot.press("y")
        again = await screen_of(pilot, ScaleModal)
        problem = str(again.query_one("#scale-problem", Label).render())
        assert problem.startswith("tiny: replicas: ") and "1000" in problem and "\n" not in problem
        assert again.query_one("#replicas", Input).value == "5000"
