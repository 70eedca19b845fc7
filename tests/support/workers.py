"""Helpers for tests of a daemon with worker processes (`server.workers`): its processes, and client connections
sorted by the process serving each (`procnet`)."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any

from tests.support.daemon import WAIT_S, Daemon, wait_until
from tests.support.procnet import children, serving_pid


def start_with_workers(daemon: Daemon) -> Daemon:
    """Start `daemon` and wait until its worker serves (a worker process's start-up takes seconds, and many more on
    a busy machine); stopped again if it does not, so no daemon is left behind."""
    daemon.start()
    try:
        wait_until(lambda: "worker 1 serving" in daemon.log(), 2 * WAIT_S, "the worker to serve")
    except BaseException:
        daemon.close()
        raise
    return daemon


def processes(daemon: Daemon) -> list[int]:
    """The daemon's serving processes: the primary first, then its worker."""
    assert daemon.process is not None
    primary = daemon.process.pid
    workers = [pid for pid in children(primary) if "spawn_main" in _cmdline(pid)]
    return [primary, *workers]


def _cmdline(pid: int) -> str:
    """The command line of `pid`, or "" once it has ended (it may, between listing and reading)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


class Connections:
    """Client connections to the daemon, sorted by the process serving each; closed at the end."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.pids = processes(daemon)
        assert len(self.pids) == 2, self.pids
        self.by_pid: dict[int, list[http.client.HTTPConnection]] = {pid: [] for pid in self.pids}
        self._spare: list[http.client.HTTPConnection] = []

    def on(self, pid: int, *, source: str = "127.0.0.1") -> http.client.HTTPConnection:
        """A new connection that `pid` serves, from the address `source`."""
        for _ in range(400):
            connection = http.client.HTTPConnection(
                "127.0.0.1", self.daemon.port, timeout=30, source_address=(source, 0)
            )
            connection.connect()
            deadline = time.monotonic() + 5
            while (server := serving_pid(connection, self.pids)) is None and time.monotonic() < deadline:
                time.sleep(0.005)
            assert server is not None, "no serving process accepted the connection"
            if server == pid:
                self.by_pid[pid].append(connection)
                return connection
            self._spare.append(connection)
        raise AssertionError(f"process {pid} accepted none of 400 connections")

    def close(self) -> None:
        for connection in [*self._spare, *(c for group in self.by_pid.values() for c in group)]:
            connection.close()


def ask(connection: http.client.HTTPConnection, model: str, *, stream: bool = False, **extra: Any) -> None:
    """Send a chat completion request on `connection` (read its answer with `answer`)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream, **extra}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})


def answer(connection: http.client.HTTPConnection) -> tuple[int, dict[str, str], bytes]:
    response = connection.getresponse()
    names = [k.lower() for k, _ in response.getheaders()]
    assert names.count("x-request-id") == 1, response.getheaders()
    assert names.count("access-control-allow-origin") <= 1, response.getheaders()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


def get(connection: http.client.HTTPConnection, path: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    connection.request("GET", path, headers=headers)
    return answer(connection)
