"""The real DMTF Redfish emulator of OpenStack (`sushy-tools`, a dev dependency) on loopback, with its fake driver:
one computer system whose power state follows reset actions some seconds later, behind HTTP basic authentication
(a bcrypt htpasswd file)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import bcrypt
import httpx

from tests.support.cli import untraced_environ
from tests.support.daemon import free_port, stop_process

SYSTEM_ID = "27946b59-9e44-4fa7-8e91-f3527a1ef094"
USERNAME = "admin"
PASSWORD = "bmc-secret-7f3a"


class RedfishEmulator:
    """`sushy-emulator` on 127.0.0.1 and a free port, its state in `directory`; stopped by its PID."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> RedfishEmulator:
        htpasswd = self.directory / "htpasswd"
        digest = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
        htpasswd.write_text(f"{USERNAME}:{digest}\n")
        config = self.directory / "emulator.conf"
        config.write_text(
            f"SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'\n"
            f"SUSHY_EMULATOR_LISTEN_PORT = {self.port}\n"
            f"SUSHY_EMULATOR_STATE_DIR = {str(self.directory / 'state')!r}\n"
            f"SUSHY_EMULATOR_AUTH_FILE = {str(htpasswd)!r}\n"
            "SUSHY_EMULATOR_FAKE_DRIVER = True\n"
            f"SUSHY_EMULATOR_FAKE_SYSTEMS = [{{'uuid': {SYSTEM_ID!r}, 'name': 'gpu-host', 'power_state': 'Off', "
            "'nics': [{'mac': '00:5c:52:31:3a:9c', 'ip': '127.0.0.2'}]}]\n"
        )
        binary = Path(sys.executable).with_name("sushy-emulator")
        log = (self.directory / "emulator.log").open("ab")
        self.process = subprocess.Popen(
            [str(binary), "--config", str(config)], stdout=log, stderr=subprocess.STDOUT, env=untraced_environ()
        )
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/redfish/v1/Systems", auth=(USERNAME, PASSWORD), timeout=1).is_success:
                    return self
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"sushy-emulator exited with {self.process.returncode}; see {log.name}")
            time.sleep(0.1)
        raise RuntimeError("sushy-emulator did not become ready")

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, timeout_s=10)

    def __enter__(self) -> RedfishEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
