"""Host power through the daemon: the admin API and `qiip node power` against the real Redfish emulator
(sushy-tools) on loopback, and the refusals that come before any network work."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import run_qiip
from tests.support.daemon import Daemon
from tests.support.redfish import PASSWORD, SYSTEM_ID, USERNAME, RedfishEmulator

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, redfish_emulator: RedfishEmulator) -> Iterator[Daemon]:
    directory = tmp_path_factory.mktemp("power")
    password = directory / "bmc-password"
    password.write_text(PASSWORD)
    password.chmod(0o600)
    env = {
        "QIIP_REDFISH__BMC_URL_TEMPLATE": f"http://{{hostname}}:{redfish_emulator.port}",
        "QIIP_REDFISH__USERNAME": USERNAME,
        "QIIP_REDFISH__PASSWORD_FILE": str(password),
    }
    with Daemon(directory / "state", env=env) as running:
        yield running


def test_power_state_and_an_action_through_the_admin_api(daemon: Daemon) -> None:
    state = daemon.admin.get(f"/admin/nodes/{HOST}/power")
    assert state.status_code == 200, state.text
    assert state.json()["system_id"] == SYSTEM_ID and state.json()["power_state"] in {"On", "Off"}
    action = daemon.admin.post(f"/admin/nodes/{HOST}/power", json={"action": "On"})
    assert action.status_code == 200, action.text
    assert action.json()["action"] == "On" and action.json()["system_id"] == SYSTEM_ID
    assert PASSWORD not in daemon.log()


@pytest.mark.parametrize(
    ("host", "body", "code"),
    [
        (HOST, {"action": "Nmi"}, "invalid_power_action"),
        (HOST, {}, "invalid_power_action"),
        ("10.20.30.40", {"action": "ForceOff"}, "host_not_allowed"),
        ("gpu01.example.com", {"action": "On"}, "host_not_allowed"),
    ],
)
def test_refusals_before_any_network_work(daemon: Daemon, host: str, body: dict[str, str], code: str) -> None:
    answer = daemon.admin.post(f"/admin/nodes/{host}/power", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == code


def test_qiip_node_power(daemon: Daemon, tmp_path: Path) -> None:
    env = {"QIIP_URL": daemon.url, "QIIP_ADMIN__USERNAME": "admin", "QIIP_ADMIN__PASSWORD": "test-password"}
    status = run_qiip(tmp_path, "node", "power", HOST, "status", env=env)
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith(f"{HOST}: ") and f"(system {SYSTEM_ID})" in status.stdout
    refused = run_qiip(tmp_path, "node", "power", "10.20.30.40", "off", env=env)
    assert refused.returncode != 0
    assert "10.20.30.40" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
