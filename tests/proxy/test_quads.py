"""QUADS through the daemon: `GET /admin/nodes` merges the GPU hosts QUADS lends with the registered nodes, a
setup of a host reserved within the lookahead is refused with 400 and, while QUADS is down, with 503, both before
any SSH or power work (the host's SSH and BMC ports are listeners that count connections)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from qiip_core.client import QiipClient
from tests.support.cli import run_qiip
from tests.support.daemon import Daemon, wait_until
from tests.support.quads import QuadsServer

pytestmark = pytest.mark.integration

RESERVED = "127.0.0.31"
LENT = "127.0.0.32"
UNKNOWN = "127.0.0.33"
BROKEN = "127.0.0.34"


class Listener:
    """One TCP port on each test host's address that accepts connections, counts them and says nothing."""

    def __init__(self, addresses: tuple[str, ...] = (RESERVED, LENT, UNKNOWN, BROKEN)) -> None:
        for _ in range(20):
            first = socket.create_server((addresses[0], 0))
            self.port: int = first.getsockname()[1]
            self.socks = [first]
            try:
                self.socks += [socket.create_server((a, self.port)) for a in addresses[1:]]
                break
            except OSError:
                for sock in self.socks:
                    sock.close()
        else:
            raise RuntimeError("no port free on every test address")
        self.accepted: list[str] = []
        self._open: list[socket.socket] = []
        for sock in self.socks:
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            self._open.append(conn)
            self.accepted.append(sock.getsockname()[0])

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        for conn in self._open:
            conn.close()


@pytest.fixture
def listeners() -> Iterator[tuple[Listener, Listener]]:
    ssh, bmc = Listener(), Listener()
    yield ssh, bmc
    ssh.close()
    bmc.close()


def setup(daemon: Daemon, host: str) -> Any:
    return daemon.admin.post("/admin/nodes/setup", json={"hostname": host, "engine": "vllm", "model": "org/m"})


def entries(daemon: Daemon) -> dict[str, dict[str, Any]]:
    return {n["id"]: n for n in daemon.admin.get("/admin/nodes").json()["nodes"]}


def test_the_fleet_view_setup_refusals_and_quads_down_then_back(
    tmp_path: Path, listeners: tuple[Listener, Listener]
) -> None:
    ssh, bmc = listeners
    now = datetime.now(UTC)
    with QuadsServer(timezone="America/New_York") as quads:
        quads.add_host(RESERVED, gpus=8, product="H100 80GB HBM3")
        quads.add_host(LENT, gpus=2, vendor="AMD", product="MI300X")
        quads.add_host(BROKEN, gpus=8, broken=True)
        quads.reserve(RESERVED, now + timedelta(hours=3), now + timedelta(hours=10), owner="erin", ticket="9001")
        env = {
            "QIIP_QUADS__URL": quads.url,
            "QIIP_QUADS__TIMEZONE": "America/New_York",
            "QIIP_QUADS__POLL_INTERVAL_S": "0.2",
            "QIIP_QUADS__ENFORCE_INTERVAL_S": "0.2",
            "QIIP_QUADS__TIMEOUT_S": "2",
            # The hosts' SSH server and BMC: listeners that count every connection.
            "QIIP_PROVISIONING__SSH_PORT": str(ssh.port),
            "QIIP_PROVISIONING__SSH_WAIT_TIMEOUT_S": "30",
            "QIIP_PROVISIONING__CONNECT_TIMEOUT_S": "30",
            "QIIP_REDFISH__BMC_URL_TEMPLATE": f"http://{{hostname}}:{bmc.port}",
            "QIIP_REDFISH__TIMEOUT_S": "30",
            "QIIP_PROVISIONING__NVIDIA_DRIVER_VERSION": "580.126.09",
            "QIIP_PROVISIONING__NVIDIA_DRIVER_SHA256": "0" * 64,
        }
        with Daemon(tmp_path / "state", env=env) as daemon:
            refused = setup(daemon, RESERVED)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["code"] == "host_reserved" and error["param"] == "hostname"
            start = (now + timedelta(hours=3)).strftime("%Y-%m-%d %H:%M UTC")
            assert f"Host {RESERVED} is reserved in QUADS from {start} for cloud02 (owner erin" in error["message"]
            broken = setup(daemon, BROKEN)
            assert broken.status_code == 400 and broken.json()["error"]["code"] == "host_reserved", broken.text
            assert f"Host {BROKEN} is marked broken in QUADS: it is not set up" in broken.json()["error"]["message"]

            # The fleet view: QUADS' hosts that are not nodes, without engine or artifact; a node keeps its shape.
            daemon.add_node(LENT, f"http://{LENT}:8000", "org/m", wait=False)
            wait_until(lambda: {RESERVED, LENT} <= set(entries(daemon)), what="the QUADS hosts in the view")
            wait_until(lambda: entries(daemon)[LENT]["engine"] == "vllm", what="the node to be registered")
            view = entries(daemon)
            reserved = view[RESERVED]
            assert (reserved["status"], reserved["engine"], reserved["artifact_id"], reserved["endpoint"]) == (
                "not_provisioned",
                None,
                None,
                None,
            )
            assert reserved["source"] == "quads" and not reserved["managed"]
            assert reserved["quads"]["gpus"] == {"vendor": "NVIDIA", "product": "H100 80GB HBM3", "count": 8}
            upcoming = reserved["quads"]["next_reservation"]
            assert (upcoming["owner"], upcoming["cloud"], upcoming["ticket"]) == ("erin", "cloud02", "9001")
            assert datetime.fromisoformat(upcoming["start"]) == (now + timedelta(hours=3)).replace(
                second=0, microsecond=0
            )
            assert reserved["quads"]["conflict_within_lookahead"] and not reserved["quads"]["available"]
            node = view[LENT]
            assert node["engine"] == "vllm" and node["endpoint"] == f"http://{LENT}:8000" and node["source"] != "quads"
            assert node["quads"]["gpus"] == {"vendor": "AMD", "product": "MI300X", "count": 2}
            assert node["quads"]["next_reservation"] is None and node["quads"]["next_conflict_at"] is None
            assert daemon.admin.get(f"/admin/nodes/{LENT}").json()["quads"]["host"] == LENT

            async def client_view() -> tuple[list[Any], Any]:
                async with QiipClient(daemon.url, username="admin", password="test-password") as client:
                    return await client.nodes(), await client.lent_hosts()

            # The console's and the CLI's client: the node with its QUADS view, the bare QUADS hosts left out of the
            # nodes and listed apart, with the freshness of the read.
            [seen], lent = asyncio.run(client_view())
            assert seen.id == LENT and seen.quads is not None and seen.quads.gpus["count"] == 2
            assert [host.host for host in lent.hosts] == [RESERVED]
            assert lent.hosts[0].next_reservation is not None and lent.hosts[0].next_reservation.owner == "erin"
            assert lent.freshness is not None and lent.freshness.hosts == 2 and lent.freshness.fetched_at is not None

            # The CLI says the same in words.
            cli_env = {"QIIP_URL": daemon.url, "QIIP_ADMIN__USERNAME": "admin", "QIIP_ADMIN__PASSWORD": "test-password"}
            (tmp_path / "cli").mkdir()
            said = run_qiip(tmp_path / "cli", "node", "quads", env=cli_env)
            assert said.returncode == 0, said.stderr
            back = datetime.fromisoformat(upcoming["start"]).strftime("%Y-%m-%d %H:%M")
            # (A line on the data's age comes first when the last read is older than two polls: on a busy machine.)
            lines = [line for line in said.stdout.splitlines() if not line.startswith("QUADS data ")]
            assert lines == [
                f"{LENT} (node): free",
                f"{RESERVED} (not provisioned): returned at {back} UTC, inside the lookahead · reserved from {back} "
                "UTC for cloud02",
            ]

            # QUADS down: no setup (503), the last data kept and said to be stale; then back.
            quads.stop()
            for host in (RESERVED, UNKNOWN):
                down = setup(daemon, host)
                assert down.status_code == 503, down.text
                assert down.json()["error"]["code"] == "quads_unavailable" and down.headers["retry-after"] == "30"
                assert f"QUADS cannot say whether {host} is free" in down.json()["error"]["message"]
            wait_until(lambda: entries(daemon)[RESERVED]["quads"]["stale"], what="the data to be stale")
            freshness = daemon.admin.get("/admin/nodes").json()["quads"]
            assert freshness["stale"] and freshness["age_s"] > 0 and freshness["hosts"] == 2
            assert "cannot be reached" in freshness["last_error"]
            stale = entries(daemon)[RESERVED]["quads"]
            assert "cannot be reached" in stale["last_error"] and stale["next_reservation"]["owner"] == "erin"
            assert daemon.admin.get("/admin/provisioning/tasks").json()["tasks"] == []
            assert ssh.accepted == [] and bmc.accepted == []  # no power, no SSH

            quads.start()
            wait_until(lambda: entries(daemon)[RESERVED]["quads"]["last_error"] is None, what="QUADS to be back")

            # A host QUADS does not lend passes the check: the setup goes on to power and SSH (the listeners
            # hear it), which shows the refusals above stopped before them.
            accepted = setup(daemon, UNKNOWN)
            assert accepted.status_code == 202, accepted.text
            wait_until(lambda: bool(bmc.accepted or ssh.accepted), what="the setup to reach the host")
            assert set(bmc.accepted + ssh.accepted) == {UNKNOWN}  # nothing reached the broken host either
            assert daemon.admin.post(f"/admin/provisioning/{UNKNOWN}/cancel", json={}).status_code == 202
