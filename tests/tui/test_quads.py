"""QUADS in the console: the fleet summary's QUADS line and a node's countdown to its host being taken back.

The text functions are tested alone; the console against a real daemon reading the QUADS test server, which lends
`gpu03.lab` (a node, reserved from 2h 14m after the console's frozen time) and `gpu07.lab`, `gpu08.lab` (not
nodes).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from rich.style import Style

from qiip_core.client import LentHosts, NodeInfo, QuadsView
from qiip_tui import QiipConsole
from qiip_tui._quads import countdown, gpus_label, quads_line, quads_summary, short_host
from qiip_tui._render import Palette
from qiip_tui.screens import FleetScreen, NodeScreen
from qiip_tui.widgets import FleetSummary, NodeHeader
from tests.support.daemon import Daemon
from tests.support.fault_backend import FaultBackend
from tests.support.quads import QuadsServer
from tests.tui.conftest import config_for, screen_of, wait_for

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
PALETTE = Palette({"log-warning": Style(color="yellow"), "log-error": Style(color="red")})


def view(host: str, **fields: Any) -> QuadsView:
    return QuadsView.model_validate(
        {"host": host, "gpus": {"vendor": "NVIDIA", "product": "H100 80GB HBM3", "count": 8}, **fields}
    )


def node(node_id: str, quads: QuadsView | None) -> NodeInfo:
    return NodeInfo(
        id=node_id, endpoint=f"http://{node_id}:8000", status="healthy", model="m", engine="vllm"
    ).model_copy(update={"quads": quads})


def lent(*hosts: QuadsView, stale: bool = False, age_s: float = 30.0, total: int = 3) -> LentHosts:
    freshness = {"fetched_at": NOW.isoformat(), "age_s": age_s, "stale": stale, "hosts": total}
    return LentHosts.model_validate({"hosts": [h.model_dump() for h in hosts], "freshness": freshness})


def styles_of(text: Any, part: str) -> set[str]:
    start = text.plain.index(part)
    return {str(span.style) for span in text.spans if span.start <= start < span.end}


# -- the text --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("delta", "shown"),
    [
        (timedelta(hours=2, minutes=14, seconds=59), "2h 14m"),
        (timedelta(days=3, hours=4, minutes=5), "3d 4h"),
        (timedelta(minutes=14), "14m"),
        (timedelta(seconds=45), "45s"),
        (timedelta(0), "now"),
        (timedelta(minutes=-5), "now"),
    ],
)
def test_a_countdown_in_its_two_largest_units(delta: timedelta, shown: str) -> None:
    assert countdown(NOW + delta, NOW) == shown


def test_host_names_and_gpus_are_shortened_for_the_summary() -> None:
    assert (short_host("gpu07.lab.example.com"), short_host("127.0.0.32"), short_host("gpu07")) == (
        "gpu07",
        "127.0.0.32",
        "gpu07",
    )
    h100 = {"vendor": "NVIDIA", "product": "H100 80GB HBM3", "count": 8}
    assert (gpus_label(h100), gpus_label(h100, full=True)) == ("8× H100", "8× NVIDIA H100 80GB HBM3")
    named = {"vendor": "NVIDIA", "product": "NVIDIA A100 80GB", "count": 4}
    assert (gpus_label(named), gpus_label(named, full=True)) == ("4× A100", "4× NVIDIA A100 80GB")
    assert gpus_label({"count": 2}) == "2 GPUs" and gpus_label({}) == ""
    # The model stays: not the product line's name, the memory or the form factor.
    for vendor, product, short in [
        ("AMD", "Instinct MI300X", "2× MI300X"),
        ("NVIDIA", "GeForce RTX 4090", "2× RTX 4090"),
        ("NVIDIA", "RTX A6000", "2× RTX A6000"),
        ("NVIDIA", "H100 NVL", "2× H100"),
        ("AMD", "AMD Instinct MI210 64GB", "2× MI210"),
    ]:
        assert gpus_label({"vendor": vendor, "product": product, "count": 2}) == short


def test_the_summary_line_names_the_next_return_then_the_hosts_not_provisioned() -> None:
    reserved = view("gpu03.lab", next_conflict_at=(NOW + timedelta(hours=2, minutes=14)).isoformat())
    later = view("gpu04.lab", next_conflict_at=(NOW + timedelta(days=9)).isoformat())
    nodes = [node("gpu04.lab", later), node("gpu03.lab", reserved), node("gpu05", None)]
    hosts = (view("gpu07.lab"), view("gpu08.lab", gpus={"vendor": "NVIDIA", "product": "A100", "count": 4}))
    line = quads_summary(lent(*hosts), nodes, NOW, PALETTE)
    assert line is not None
    assert line.plain == "QUADS: next return gpu03 in 2h 14m · 2 hosts not provisioned: gpu07 8× H100, gpu08 4× A100"
    assert styles_of(line, "next return") == set(), "outside the lookahead: no warning"

    # Within the lookahead, the warning colour; once due, the error colour.
    urgent = [node("gpu03.lab", reserved.model_copy(update={"conflict_within_lookahead": True}))]
    line = quads_summary(lent(), urgent, NOW, PALETTE)
    assert line is not None
    assert line.plain == "QUADS: next return gpu03 in 2h 14m, inside the lookahead · every lent host is a node"

    # A host reserved for another tenant is no host to set up: listed apart, with whom it goes to.
    taken = view(
        "gpu09.lab",
        available=False,
        next_reservation={"start": NOW.isoformat(), "end": NOW.isoformat(), "owner": "erin"},
    )
    line = quads_summary(lent(view("gpu07.lab"), taken), urgent, NOW, PALETTE)
    assert line is not None and line.plain.endswith(
        "· 1 host not provisioned: gpu07 8× H100 · 1 reserved for others: gpu09 (erin)"
    )
    assert styles_of(line, "next return") == {"yellow"}
    line = quads_summary(lent(), urgent, NOW + timedelta(hours=3), PALETTE)
    assert line is not None and "next return gpu03 now" in line.plain and styles_of(line, "next return") == {"red"}


def test_the_summary_line_says_how_old_stale_data_is_and_nothing_without_quads() -> None:
    free = [node("gpu03.lab", view("gpu03.lab"))]
    line = quads_summary(lent(stale=True, age_s=12 * 60 + 5, total=1), free, NOW, PALETTE)
    assert line is not None and line.plain == "QUADS data 12m old · no node's host reserved · every lent host is a node"
    assert styles_of(line, "QUADS data") == {"yellow"}
    assert quads_summary(None, free, NOW, PALETTE) is None, "a client without lent_hosts()"
    assert quads_summary(LentHosts(), free, NOW, PALETTE) is None, "a daemon without [quads]"
    unread = LentHosts.model_validate({"freshness": {"stale": True, "last_error": "QUADS cannot be reached"}})
    line = quads_summary(unread, [], NOW, PALETTE)
    assert line is not None and line.plain == "QUADS not read yet: QUADS cannot be reached"


def test_a_nodes_quads_line_counts_down_to_its_host_being_taken_back() -> None:
    start = NOW + timedelta(hours=2, minutes=14)
    reservation = {"start": start.isoformat(), "end": (start + timedelta(days=7)).isoformat()}
    reserved = view(
        "gpu03.lab",
        next_reservation=reservation | {"cloud": "cloud02", "owner": "alice"},
        next_conflict_at=start.isoformat(),
        conflict_within_lookahead=True,
    )
    line = quads_line(reserved, NOW, PALETTE)
    assert line.plain == (
        "QUADS returned in 2h 14m, inside the lookahead · reserved from 2026-12-01 14:14 UTC for cloud02, owner alice"
        " · 8× NVIDIA H100 80GB HBM3"
    )
    assert styles_of(line, "returned in") == {"yellow"}
    assert quads_line(reserved, start, PALETTE).plain.startswith("QUADS returned now ·")
    assert styles_of(quads_line(reserved, start, PALETTE), "returned now") == {"red"}


def test_a_managed_nodes_quads_line_says_when_it_is_torn_down_in_words() -> None:
    start = NOW + timedelta(days=1, hours=2, minutes=14)
    reservation = {"start": start.isoformat(), "end": (start + timedelta(days=7)).isoformat()}
    later = view(
        "gpu03.lab",
        next_reservation=reservation,
        next_conflict_at=start.isoformat(),
        teardown_at=(start - timedelta(days=1)).isoformat(),
    )
    line = quads_line(later, NOW, PALETTE, managed=True)
    assert line.plain.startswith("QUADS torn down at 14:14 UTC, in 2h 14m · reserved from 2026-12-02 14:14 UTC")
    assert later.teardown_words(NOW) == "torn down at 14:14 UTC"
    assert later.teardown_words(NOW - timedelta(days=1)) == "torn down at 2026-12-01 14:14 UTC"
    due = later.model_copy(update={"conflict_within_lookahead": True, "teardown_at": NOW})
    assert quads_line(due, NOW, PALETTE, managed=True).plain.startswith("QUADS inside the lookahead: torn down now ·")
    assert styles_of(quads_line(due, NOW, PALETTE, managed=True), "inside the lookahead") == {"red"}
    broken = view("gpu03.lab", broken=True, teardown_at=NOW.isoformat())
    assert quads_line(broken, NOW, PALETTE, managed=True).plain.startswith("QUADS torn down now: QUADS marks it broken")
    assert quads_line(broken, NOW, PALETTE).plain.startswith("QUADS marked broken ·")
    assert view("gpu03.lab").teardown_words(NOW) == "no teardown due"
    free = quads_line(view("gpu03.lab", stale=True, data_age_s=700), NOW, PALETTE)
    assert free.plain == "QUADS free · no reservation · 8× NVIDIA H100 80GB HBM3 · QUADS data 11m old"


# -- against a daemon ------------------------------------------------------------------------------------------

START = datetime.now(UTC).replace(second=0, microsecond=0)
"""The console's frozen time of day: QUADS keeps reservations to the minute, so the countdown is exact."""


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[tuple[Daemon, QuadsServer]]:
    """A daemon reading QUADS, with the node `gpu03.lab` on a host QUADS lends and reserves from START + 2h 14m."""
    with QuadsServer(timezone="America/New_York") as quads, FaultBackend(model="m1") as backend:
        quads.add_host("gpu03.lab", gpus=8, product="H100 80GB HBM3")
        quads.add_host("gpu07.lab", gpus=8, product="H100 80GB HBM3")
        quads.add_host("gpu08.lab", gpus=4, product="A100 80GB PCIe")
        quads.reserve("gpu03.lab", START + timedelta(hours=2, minutes=14), START + timedelta(days=2), owner="erin")
        env = {
            "QIIP_QUADS__URL": quads.url,
            "QIIP_QUADS__TIMEZONE": "America/New_York",
            "QIIP_QUADS__POLL_INTERVAL_S": "0.5",
            "QIIP_QUADS__TIMEOUT_S": "2",
        }
        with Daemon(tmp_path / "state", env=env) as daemon:
            daemon.add_node("gpu03.lab", backend.url, "m1")
            yield daemon, quads


def _summary(app: QiipConsole) -> str:
    return str(app.screen.query_one(FleetSummary).render())


@pytest.mark.integration
async def test_the_summary_shows_the_lent_hosts_and_a_node_counts_down_to_its_return(
    lab: tuple[Daemon, QuadsServer],
) -> None:
    daemon, quads = lab
    app = QiipConsole(config_for(daemon), metrics_interval_s=0.3, wall_clock=lambda: START)
    async with app.run_test(size=(160, 40)) as pilot:
        await screen_of(pilot, FleetScreen)
        await wait_for(
            pilot, lambda: "QUADS: next return" in _summary(app) and "gpu08" in _summary(app), what="the QUADS line"
        )
        line = _summary(app).splitlines()[2]
        assert line == (
            "QUADS: next return gpu03 in 2h 14m, inside the lookahead · 2 hosts not provisioned: gpu07 8× H100, "
            "gpu08 4× A100"
        )
        # The lent hosts are not nodes: no row, nothing a node action could reach.
        assert set(app.fleet.nodes) == {"gpu03.lab"}

        await pilot.press("enter")
        screen = await screen_of(pilot, NodeScreen)
        assert screen.node_id == "gpu03.lab"
        header = str(screen.query_one(NodeHeader).render()).splitlines()
        start = START + timedelta(hours=2, minutes=14)
        # On a loaded machine a poll may come late: the data's age is said then, as the last part (tested below).
        assert re.sub(r" · QUADS data \S+ old$", "", header[2]) == (
            f"QUADS returned in 2h 14m, inside the lookahead · reserved from {start:%Y-%m-%d %H:%M} UTC for cloud02, "
            "owner erin"
            " · 8× NVIDIA H100 80GB HBM3"
        )

        # QUADS goes down: the daemon keeps its last read, and the summary says how old it is.
        await pilot.press("escape")
        await screen_of(pilot, FleetScreen)
        quads.stop()
        await wait_for(pilot, lambda: _summary(app).splitlines()[2].startswith("QUADS data "), what="stale QUADS data")
        assert (
            " old · next return gpu03 in 2h 14m, inside the lookahead · 2 hosts not provisioned: "
            in (_summary(app).splitlines()[2])
        )
