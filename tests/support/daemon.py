"""Run the real daemon (`python -m qiip_proxy`) on a loopback port for integration tests."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from qiip_core.config import load_settings
from qiip_core.discovery import add_to_state_file, remove_from_state_file
from qiip_core.nodes import Engine, Node, NodeCapabilities
from tests.support.cli import clean_environ
from tests.support.zygote import DaemonProcess, spawn_daemon

FAST_ENV = {
    # A probe of each node 4 times a second: a node's failure is seen within a quarter second, and a daemon of six
    # nodes does not spend a tenth of a core on probes while its test waits.
    "QIIP_HEALTH__INTERVAL_S": "0.25",
    "QIIP_HEALTH__TIMEOUT_S": "2",
    "QIIP_HEALTH__FAILURE_THRESHOLD": "1",
    "QIIP_REGISTRY__POLL_INTERVAL_S": "0.05",
    "QIIP_UPSTREAM__CONNECT_TIMEOUT_S": "2",
    "QIIP_UPSTREAM__TTFB_TIMEOUT_S": "10",
    "QIIP_UPSTREAM__GENERATION_TIMEOUT_S": "10",
    "QIIP_UPSTREAM__IDLE_TIMEOUT_S": "10",
    "QIIP_LOGGING__LEVEL": "INFO",
    # One serving process: a test reads the metrics right after its request (a worker's reach the primary within
    # 0.1 s). The tests of workers set their own.
    "QIIP_SERVER__WORKERS": "1",
    "QIIP_ADMIN__USERNAME": "admin",
    "QIIP_ADMIN__PASSWORD": "test-password",
    # Tests send many wrong credentials on purpose; the throttle has tests of its own.
    "QIIP_ADMIN__AUTH_FAILURE_BURST": "1000000",
}
"""Settings that make a test daemon react in tenths of a second instead of seconds."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


WAIT_S = 60.0
"""How long a test waits at most for a state it expects (a node healthy, a record written): a bound for a machine
busy with other work, never an expectation; a test that passes only waits as long as the state takes."""


POLL_FIRST_S = 0.02
"""The first pause of `wait_until`: a state that is nearly there is seen at once."""
POLL_MAX_S = 0.2
"""The longest pause of `wait_until`: a long wait (a replica's setup, a rollout) asks 5 times a second."""


def wait_until(predicate: Callable[[], bool], timeout_s: float = WAIT_S, what: str = "condition") -> None:
    """Poll `predicate` until it is true: after 20 ms, then a quarter longer each time, up to every 200 ms.

    Most predicates ask a daemon (its `/metrics`, an admin route): at a fixed 20 ms a minute's wait cost the test
    and the daemon 3,000 answers of CPU, which on a shared machine is taken from every other test.

    Raises:
        TimeoutError: it was still false after `timeout_s` seconds.
    """
    deadline = time.monotonic() + timeout_s
    pause_s = POLL_FIRST_S
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(pause_s)
        pause_s = min(POLL_MAX_S, pause_s * 1.25)
    raise TimeoutError(f"timed out waiting for {what}")


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed the client socket `sock` (what it sent, if anything, is read first); never waits
    (the socket is left non-blocking)."""
    sock.setblocking(False)
    try:
        while chunk := sock.recv(65536):
            del chunk
    except BlockingIOError:
        return False
    except ConnectionError:
        return True
    return True


def stop_process(process: DaemonProcess, *, sig: int = signal.SIGTERM, timeout_s: float) -> int:
    """Send `sig` to `process` if it still runs and wait for it to end; kill it after `timeout_s` seconds.

    Returns:
        Its exit code (negative: the signal that ended it).
    """
    if (code := process.poll()) is not None:
        return code
    process.send_signal(sig)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


class Daemon:
    """A `qiip-proxy` process with its own state directory.

    Args:
        state_dir: the daemon's `QIIP_STATE_DIR`.
        env: extra settings as environment variables (on top of `FAST_ENV`).
        config: an optional TOML config file.
        new_process: start it as a new process, never a fork of the zygote (tests/support/zygote.py).
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        env: dict[str, str] | None = None,
        config: Path | None = None,
        new_process: bool = False,
    ) -> None:
        self.state_dir = state_dir
        self.new_process = new_process
        self.env = {**FAST_ENV, **(env or {}), "QIIP_STATE_DIR": str(state_dir)}
        self.config = config
        self.log_path = state_dir / "daemon.log"
        self.process: DaemonProcess | None = None
        self._use_port(free_port())

    def _use_port(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.Client(base_url=self.url, trust_env=False, timeout=30.0)
        self.admin = httpx.Client(
            base_url=self.url,
            trust_env=False,
            timeout=30.0,
            auth=(self.env["QIIP_ADMIN__USERNAME"], self.env["QIIP_ADMIN__PASSWORD"]),
        )

    def start(self, *, healthy: bool = True) -> Daemon:
        """Start the daemon and wait until `/health` answers 200 (any answer with `healthy` False)."""
        self._healthy = healthy
        # A free port can be taken by another process between our probe and the daemon's bind: try again.
        for attempt in range(3):
            try:
                return self._start()
            except RuntimeError as exc:
                if "Cannot listen on" not in str(exc) or attempt == 2:
                    raise
                self.client.close()
                self.admin.close()
                self._use_port(free_port())
        raise AssertionError("unreachable")

    def _start(self) -> Daemon:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = clean_environ() | self.env
        args = ["--port", str(self.port)]
        if self.config is not None:
            args += ["--config", str(self.config)]
        self.process = spawn_daemon(args, env, self.state_dir, self.log_path, fork=not self.new_process)
        try:
            # Python's start-up alone takes seconds when other processes share the cores.
            wait_until(self._up, 2 * WAIT_S, "the daemon to listen")
        except BaseException:
            # `__exit__` does not run when `__enter__` raises: never leave a daemon behind that later listens.
            self.stop()
            raise
        return self

    def _up(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"the daemon exited with {self.process.returncode}:\n{self.log()}")
        try:
            status = self.client.get("/health").status_code
        except httpx.HTTPError:
            return False
        return status == 200 or not getattr(self, "_healthy", True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process is None:
            return 0
        return stop_process(self.process, sig=sig, timeout_s=30)

    def close(self) -> None:
        self.stop()
        self.client.close()
        self.admin.close()

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the fleet -------------------------------------------------------------------------------------------

    def settings(self) -> Any:
        return load_settings(state_dir=self.state_dir)

    def add_node(
        self, node_id: str, endpoint: str, model: str, *, engine: Engine = Engine.VLLM, wait: bool = True, **caps: Any
    ) -> None:
        node = Node(id=node_id, endpoint=endpoint, model=model, engine=engine, capabilities=NodeCapabilities(**caps))
        add_to_state_file(self.settings(), node, replace=True)
        if wait:
            self.wait_status(node_id, "healthy")

    def remove_node(self, node_id: str) -> None:
        remove_from_state_file(self.settings(), node_id)

    def metrics(self) -> str:
        return self.client.get("/metrics").text

    def node_statuses(self) -> dict[str, str]:
        statuses = {}
        for match in re.finditer(r'^qiip_node_status\{node="([^"]+)",status="([^"]+)"\} 1\.0$', self.metrics(), re.M):
            statuses[match.group(1)] = match.group(2)
        return statuses

    def wait_status(self, node_id: str, status: str, timeout_s: float = WAIT_S) -> None:
        wait_until(lambda: self.node_statuses().get(node_id) == status, timeout_s, f"node {node_id} to be {status}")

    def wait_gone(self, node_id: str, timeout_s: float = WAIT_S) -> None:
        wait_until(lambda: node_id not in self.node_statuses(), timeout_s, f"node {node_id} to leave")

    def in_flight(self, node_id: str) -> float:
        match = re.search(
            rf'^qiip_in_flight_requests\{{model="[^"]*",node="{re.escape(node_id)}"\}} (\S+)$', self.metrics(), re.M
        )
        return float(match.group(1)) if match else 0.0

    def counter(self, name: str, **labels: str) -> float:
        total = 0.0
        for match in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", self.metrics(), re.M):
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(match.group(2))
        return total


@contextlib.contextmanager
def llama_daemon_with(
    state_dir: Path,
    server_binary: Path,
    local_nodes: list[dict[str, Any]],
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> Iterator[Daemon]:
    """A daemon that runs `local_nodes` (`[[local_nodes]]` entries) on `server_binary`, once all are healthy."""
    env = {
        "QIIP_LOCAL_NODES": json.dumps(local_nodes),
        "QIIP_ENGINES__LLAMACPP__SERVER_BINARY": str(server_binary),
        **(env or {}),
    }
    with Daemon(state_dir, env=env) as daemon:
        for node in local_nodes:
            daemon.wait_status(node["id"], "healthy", timeout_s=timeout_s)
        yield daemon


def write_json(path: Path, value: Any) -> Path:
    path.write_text(json.dumps(value))
    return path
