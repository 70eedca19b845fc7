"""A real etcd server on loopback for tests (Debian package `etcd-server`)."""

from __future__ import annotations

import shutil
import subprocess
import time
from base64 import b64encode
from pathlib import Path
from typing import Any

import httpx

from qiip_core.storage import prefix_range_end
from tests.support.daemon import free_port, stop_process


class EtcdServer:
    """One etcd member on free loopback ports with its own data directory; stopped by its PID.

    `stop()` then `start()` restarts it on the same ports and data, as an outage and recovery.
    """

    def __init__(self, data_dir: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed; `scripts/setup --test` installs the etcd-server package")
        self.binary = binary
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> EtcdServer:
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            self.binary,
            "--name", "qiip-test",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"qiip-test={peer}",
            "--logger=zap",
            "--log-level=error",
        ]  # fmt: skip
        log = (self.data_dir.parent / f"{self.data_dir.name}.log").open("ab")
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.process.returncode}")
            time.sleep(0.05)
        raise RuntimeError("etcd did not become ready")

    def range_prefix(self, prefix: bytes) -> list[dict[str, Any]]:
        """Every key under `prefix` as etcd's JSON gateway gives it (base64 `key` and `value`, `lease`, …), read
        with a client closed at once."""
        body = {"key": b64encode(prefix).decode(), "range_end": b64encode(prefix_range_end(prefix)).decode()}
        answer = httpx.post(self.url + "/v3/kv/range", json=body, timeout=10)
        answer.raise_for_status()
        kvs: list[dict[str, Any]] = answer.json().get("kvs", [])
        return kvs

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, timeout_s=20)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
