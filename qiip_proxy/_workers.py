"""Every core: the worker processes the primary runs beside itself (`server.workers`).

The primary (the process `qiip-proxy` starts) binds the port, then starts `N - 1` workers (`multiprocessing`,
spawned), each handed the same listening socket: the kernel gives each new client connection to whichever
process accepts it first. All of them serve the client API; everything else runs in the primary alone.

What ties them together, in a private runtime directory (mode 0700, under `/dev/shm` where it exists):

- `in-flight.board`: the requests in flight per node, over every process (`qiip_core.routing.InFlightBoard`),
  which least-connections, concurrency caps, admission and drains read.
- `control.sock`: the primary's control channel. Each worker connects once it starts and reads the fleet: every
  node the primary's routing table holds, with its effective status, its slots and its board column, and the models
  expected from nodes still starting (`RoutingTable.expected`), then each change as it happens (the typed records of
  `_control`, one JSON line each). Each worker writes back, every 100 ms, the requests it
  finished (`_metrics.Accounted`) and its counters, which the primary's metrics add up (`/metrics` and
  `/admin/metrics` are the primary's, so they count every worker's requests), and the prefixes it routed, which
  the primary learns and passes on to the other workers with its own: prefix affinity's map is the same in
  every process, 100 to 200 ms behind; the same for the client addresses whose authentication failed (one
  throttle of wrong admin credentials and one of wrong invoke tokens, each over every process).
- `admin.sock`: the primary's app on a Unix socket; a worker passes every request it does not serve itself
  (the admin API, `/health`, `/metrics`, the chat page) to the primary through it.

A worker that exits is started again (its board row zeroed first: its requests ended with it). A worker writes on
its control channel at least every `_worker.HEARTBEAT_S`; one silent for `SILENT_S` (stopped, or its event loop
stuck) serves nobody while its reservations still count: it is killed, logged, and replaced the same way. A worker
whose primary is gone shuts down. Each worker keeps its own circuit breakers and per-address connection limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

from qiip_core.routing import InFlightBoard, TableChange
from qiip_proxy._control import (
    ControlError,
    Expected,
    Hello,
    NodeDelete,
    NodePut,
    Ready,
    Report,
    Shared,
    TokensChanged,
    decode,
    encode,
)
from qiip_proxy._metrics import Accounted

if TYPE_CHECKING:
    from qiip_core.auth import AuthThrottle
    from qiip_core.config import Settings
    from qiip_core.deployments import DemandMeter
    from qiip_core.routing import RoutingTable
    from qiip_proxy._metrics import CounterKey, GatewayMetrics

__all__ = [
    "ADMIN_SOCKET",
    "BOARD_FILE",
    "CONTROL_SOCKET",
    "PEER_HEADER",
    "PoolGateway",
    "SharingGateway",
    "WorkerPeer",
    "WorkerPool",
    "WorkerSpec",
    "create_runtime_dir",
    "keep_shared",
    "learn_shared",
    "take_shared",
]


class SharingGateway(Protocol):
    """What the shared-state exchange (`keep_shared`, `take_shared`, `learn_shared`) uses of a serving process's
    gateway: its routing table (prefix affinity's map) and its authentication throttles."""

    @property
    def table(self) -> RoutingTable: ...

    @property
    def admin_throttle(self) -> AuthThrottle: ...

    @property
    def client_throttle(self) -> AuthThrottle: ...


class PoolGateway(SharingGateway, Protocol):
    """What the worker pool uses of the primary's gateway (`qiip_proxy._gateway.Gateway` is one): its settings,
    metrics, demand meter and the deployment controller (which a request waiting for a first replica wakes), besides
    what the shared-state exchange uses."""

    @property
    def settings(self) -> Settings: ...

    @property
    def metrics(self) -> GatewayMetrics: ...

    @property
    def demand_meter(self) -> DemandMeter: ...

    def wake_controller(self) -> None:
        """Have the deployment controller look now (a request waits for a first replica)."""


logger = logging.getLogger("qiip.proxy")

PEER_HEADER = b"x-qiip-peer"
"""The client's address, as a worker passes a request on to the primary; trusted on `admin.sock` only
(`WorkerPeer`)."""

ADMIN_SOCKET = "admin.sock"
CONTROL_SOCKET = "control.sock"
BOARD_FILE = "in-flight.board"

FLEET_RESEND_S = 1.0
"""How often the primary compares every node with what the workers last got (slots change without a table
change); a table change is sent at once."""

SHARE_S = 0.1
"""How often what one process learned reaches the others (`take_shared`)."""

_RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
"""Waits before starting again a worker that exited soon after its start, one step more at each such exit."""

_STABLE_AFTER_S = 30.0
"""A worker that ran this long before it exited is started again at once."""

SILENT_S = 5.0
"""A worker that has said nothing on its control channel for this long (it writes every `_worker.HEARTBEAT_S`) is
killed and replaced."""

START_SILENT_S = 60.0
"""The same for a worker that has not greeted the primary yet: starting a process and importing the daemon takes
seconds on a busy host."""

_WATCH_S = 0.5
"""How often the primary looks at its workers."""


def create_runtime_dir() -> Path:
    """A new private directory (mode 0700) for the board and the sockets: under `/dev/shm` where it exists (the
    board then lives in memory only), else the system's temporary directory.

    Raises:
        OSError: it cannot be created.
    """
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="qiip-proxy-", dir=base))


def keep_shared(gateway: SharingGateway) -> None:
    """Start keeping, in this process, what the others must learn (`take_shared`)."""
    if gateway.table.affinity is not None:
        gateway.table.affinity.recorded = []
    gateway.admin_throttle.recorded = []
    gateway.client_throttle.recorded = []


def take_shared(gateway: SharingGateway) -> Shared | None:
    """What this process learned since the last call that the others must learn too: the prefixes it routed
    (prefix affinity's map) and the client addresses whose credentials it refused (the admin API's throttle, the
    invoke tokens' throttle); None when nothing is new."""
    affinity = gateway.table.affinity
    shared = Shared(
        prefixes=tuple(affinity.take_recorded()) if affinity is not None else (),
        admin_auth_failed=tuple(gateway.admin_throttle.take_recorded()),
        client_auth_failed=tuple(gateway.client_throttle.take_recorded()),
    )
    return shared if shared else None


def learn_shared(gateway: SharingGateway, shared: Shared) -> None:
    """Learn what another process passed on (`take_shared`), without keeping it to pass on."""
    affinity = gateway.table.affinity
    if affinity is not None:
        for node_id, hashes in shared.prefixes:
            affinity.learn(node_id, hashes)
    for peer in shared.admin_auth_failed:
        gateway.admin_throttle.learn(peer)
    for peer in shared.client_auth_failed:
        gateway.client_throttle.learn(peer)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """The worker processes a primary runs beside itself (`server.workers` above 1), as its gateway is given them.

    Attributes:
        listener: the bound listening socket the workers share.
        runtime_dir: the private directory of the board and the sockets (`create_runtime_dir`); removed when the
            pool closes.
        count: serving processes in all, the primary included (2 or more).
        target: the worker processes' entry point, called with the settings, the socket, the runtime directory,
            the row and `count` (`qiip_proxy._worker.run_worker`).
    """

    listener: socket.socket
    runtime_dir: Path
    count: int
    target: Callable[..., None]


class WorkerPeer:
    """ASGI middleware of the primary: a request that came over its Unix socket (`admin.sock`, which only its
    workers can open) has the client address its worker saw (`PEER_HEADER`), so the admin API's throttle, the
    invoke-token throttle and the logs see the real client; on any other connection the header means nothing.

    Args:
        app: the primary's app.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if scope["type"] == "http" and server is not None and server[1] is None:
            for name, value in scope["headers"]:
                if name == PEER_HEADER:
                    scope = {**scope, "client": (value.decode("latin-1"), 0)}
                    break
        await self.app(scope, receive, send)


class _Worker:
    """One worker process and its control connection."""

    def __init__(self, row: int) -> None:
        self.row = row
        self.process: BaseProcess | None = None
        self.started_at = 0.0
        self.quick_exits = 0
        self.restart_at = 0.0
        self.heard_at = 0.0
        """When it last wrote on its control channel (or was started), in `time.monotonic()` seconds."""
        self.greeted = False
        self.terminated = False
        """SIGTERM was sent to this process: it is sent once (a second one could land in the middle of its exit)."""
        self.writer: asyncio.StreamWriter | None = None
        self.counters: dict[CounterKey, float] = {}
        """Its counters' totals as it last reported them (`GatewayMetrics.counted`)."""
        self.pending: list[Shared] = []
        """What the other processes learned, not yet sent to this worker."""


def _peer_pid(writer: asyncio.StreamWriter) -> int | None:
    """The PID of the process at the other end of a Unix socket connection (`SO_PEERCRED`), None when unknown."""
    sock = writer.get_extra_info("socket")
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid: int = struct.unpack("3i", credentials)[0]
    return pid


class WorkerPool:
    """The primary's workers: started with the gateway, kept running, stopped with it.

    Args:
        gateway: the primary's gateway (its table counts on the board at `spec.runtime_dir / BOARD_FILE`).
        spec: the listening socket, the runtime directory (removed by `aclose`), the process count and the
            workers' entry point.
    """

    def __init__(self, gateway: PoolGateway, spec: WorkerSpec) -> None:
        self.gateway = gateway
        self.listener = spec.listener
        self.runtime_dir = spec.runtime_dir
        self.count = spec.count
        self._target = spec.target
        self._workers = [_Worker(row) for row in range(1, spec.count)]
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sent: dict[str, NodePut] = {}
        self._sent_expected: Expected | None = None
        self._changed = asyncio.Event()
        self._remove_listener: Callable[[], None] | None = None
        self._stopping = False

    @property
    def board(self) -> InFlightBoard:
        """The board the primary's table counts on."""
        board = self.gateway.table.board
        assert board is not None, "a worker pool needs a table on the board"
        return board

    def pids(self) -> list[int]:
        """The running workers' process ids."""
        return [w.process.pid for w in self._workers if w.process is not None and w.process.pid is not None]

    async def start(self) -> None:
        """Open the control channel and start every worker (without waiting for them to serve)."""
        self._server = await asyncio.start_unix_server(
            self._serve_worker, path=str(self.runtime_dir / CONTROL_SOCKET), limit=16 * 1024 * 1024
        )
        self._remove_listener = self.gateway.table.add_listener(self._table_changed)
        keep_shared(self.gateway)
        self._tasks = [
            asyncio.create_task(self._publish(), name="qiip-workers-fleet"),
            asyncio.create_task(self._watch(), name="qiip-workers-watch"),
            asyncio.create_task(self._share(), name="qiip-workers-share"),
        ]
        for worker in self._workers:
            self._spawn(worker)
        logger.info(
            "serving with %d processes: this one and worker pid(s) %s (runtime directory %s)",
            self.count,
            ", ".join(map(str, self.pids())),
            self.runtime_dir,
        )

    def _spawn(self, worker: _Worker) -> None:
        context = multiprocessing.get_context("spawn")
        process = context.Process(
            target=self._target,
            args=(self.gateway.settings, self.listener, self.runtime_dir, worker.row, self.count),
            name=f"qiip-proxy worker {worker.row}",
            daemon=False,
        )
        process.start()
        worker.process = process
        worker.started_at = worker.heard_at = time.monotonic()
        worker.greeted = worker.terminated = False

    def tokens_changed(self) -> None:
        """An invoke token was created or revoked here: have every worker read the token store at once, so the
        token works (or stops working, its streams ended) there too without waiting for the store's poll."""
        for worker in self._workers:
            if worker.writer is not None and not worker.writer.is_closing():
                worker.writer.write(encode(TokensChanged()))

    def begin_shutdown(self) -> None:
        """The primary stopped accepting connections: stop the workers' accepting too (SIGTERM: each finishes
        its requests for up to `server.shutdown_timeout_s`), and start none again. Call on the event loop; a second
        call signals no process twice."""
        self._stopping = True
        for worker in self._workers:
            if worker.process is not None and worker.process.exitcode is None and not worker.terminated:
                worker.process.terminate()
                worker.terminated = True

    def force_shutdown(self) -> None:
        """The primary's stop was forced: force the workers' too (SIGINT after the SIGTERM of `begin_shutdown`, as
        uvicorn's second Ctrl-C: each ends its requests still open at once). Call on the event loop."""
        for worker in self._workers:
            if worker.process is not None and worker.process.exitcode is None and worker.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.process.pid, signal.SIGINT)

    async def _watch(self) -> None:
        """Kill every worker silent for too long; start again every worker that exited, after zeroing its board
        row."""
        awake_since = last = time.monotonic()
        while not self._stopping:
            await asyncio.sleep(_WATCH_S)
            now = time.monotonic()
            if now - last > 4 * _WATCH_S:
                # This process's own loop was held up: what the workers wrote meanwhile is still unread.
                awake_since = now
            last = now
            for worker in self._workers:
                process = worker.process
                if process is not None and process.exitcode is None:
                    self._kill_if_silent(worker, process, now - max(worker.heard_at, awake_since))
                    continue
                if process is not None:
                    code = process.exitcode
                    process.close()
                    worker.process = None
                    released = self.board.row_total(worker.row)
                    self.board.clear_row(worker.row)
                    self.gateway.demand_meter.set_queued(f"worker-{worker.row}", {})
                    ran_s = now - worker.started_at
                    worker.quick_exits = 0 if ran_s >= _STABLE_AFTER_S else worker.quick_exits + 1
                    wait_s = (
                        _RESTART_BACKOFF_S[min(worker.quick_exits, len(_RESTART_BACKOFF_S)) - 1]
                        if worker.quick_exits
                        else 0.0
                    )
                    worker.restart_at = now + wait_s
                    logger.error(
                        "worker %d exited (status %s) after %.0f s; %d request(s) it had in flight released; "
                        "starting it again%s",
                        worker.row,
                        code,
                        ran_s,
                        released,
                        f" in {wait_s:g} s" if wait_s else "",
                    )
                if now >= worker.restart_at and not self._stopping:
                    self._spawn(worker)

    def _kill_if_silent(self, worker: _Worker, process: BaseProcess, silent_s: float) -> None:
        """Kill `worker` when it has been silent too long (`SILENT_S`, `START_SILENT_S` before its greeting); the
        next look finds it exited and replaces it."""
        if silent_s < (SILENT_S if worker.greeted else START_SILENT_S):
            return
        logger.error(
            "worker %d (pid %s) has said nothing for %.1f s (stopped, or its event loop is stuck): killing it",
            worker.row,
            process.pid,
            silent_s,
        )
        process.kill()
        worker.heard_at = time.monotonic()  # said once: the next look finds it exited

    # -- the fleet ------------------------------------------------------------------------------------------

    def _table_changed(self, change: TableChange) -> None:
        self._changed.set()

    def _expected(self) -> Expected:
        """The fleet message of the models expected from nodes still starting (`RoutingTable.expected`)."""
        return Expected(models=dict(self.gateway.table.expected))

    def _records(self) -> dict[str, NodePut]:
        """The fleet message of every node for the workers: the registration with its effective status, where it
        came from, its board column and its slots."""
        return {
            state.id: NodePut(node=state.effective_node(), source=state.source, column=state.column, slots=state.slots)
            for state in self.gateway.table
        }

    async def _publish(self) -> None:
        """Send the workers every node that changed since they last heard, at once on a table change, and
        every `FLEET_RESEND_S` otherwise."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), FLEET_RESEND_S)
            self._changed.clear()
            records = self._records()
            lines = [encode(r) for node_id, r in records.items() if self._sent.get(node_id) != r]
            lines += [encode(NodeDelete(node_id=node_id)) for node_id in self._sent.keys() - records.keys()]
            self._sent = records
            expected = self._expected()
            if expected != self._sent_expected:
                lines.append(encode(expected))
                self._sent_expected = expected
            if lines:
                data = b"".join(lines)
                for worker in self._workers:
                    if worker.writer is not None and not worker.writer.is_closing():
                        worker.writer.write(data)

    async def _serve_worker(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One worker's control connection: its greeting, the whole fleet, then the fleet's changes out and its
        accounting in, until it closes."""
        worker: _Worker | None = None
        try:
            hello = decode(await reader.readline())
            if not isinstance(hello, Hello) or hello.row >= self.count:
                raise ControlError(f"a worker's first message is not its greeting with a row below {self.count}")
            candidate = self._workers[hello.row - 1]
            peer = _peer_pid(writer)
            if candidate.process is None or peer != candidate.process.pid:
                # Only the process started for the row speaks for it: another one (a leftover, an impostor with
                # access to the runtime directory) would take its fleet updates away.
                raise ControlError(f"a greeting for worker {hello.row} came from pid {peer}, not from that worker")
            worker = candidate
            worker.heard_at, worker.greeted = time.monotonic(), True
            worker.counters = {}
            snapshot = [encode(r) for r in self._records().values()]
            snapshot.append(encode(self._expected()))
            affinity = self.gateway.table.affinity
            if affinity is not None and len(affinity):
                # A worker starting (or started again) begins with the prefixes every process has routed so far.
                snapshot.append(encode(Shared(prefixes=tuple(affinity.known()))))
            snapshot.append(encode(Ready()))
            writer.write(b"".join(snapshot))
            worker.writer = writer
            while line := await reader.readline():
                worker.heard_at = time.monotonic()
                report = decode(line)
                if not isinstance(report, Report):
                    raise ControlError(f"a worker sent {report.kind!r}, which only the primary sends")
                try:
                    self._account(worker, report)
                except Exception:
                    # A report the metrics cannot take must not cut the worker off its fleet (it would restart).
                    logger.exception("worker %d: a report could not be accounted; the connection stays", worker.row)
        except (ConnectionError, ValueError) as exc:
            # ValueError: a ControlError, or a line longer than the stream's limit.
            logger.warning("a worker's control connection failed: %s", exc)
        finally:
            if worker is not None and worker.writer is writer:
                worker.writer = None
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _share(self) -> None:
        """Every `SHARE_S`, send each worker what this process and the other workers learned since the last time
        (`take_shared`): prefix affinity's map and the failed-authentication throttles are then one over every
        process."""
        while True:
            await asyncio.sleep(SHARE_S)
            own = take_shared(self.gateway)
            for worker in self._workers:
                parts, worker.pending = worker.pending, []
                if own is not None:
                    parts.insert(0, own)
                if parts and worker.writer is not None and not worker.writer.is_closing():
                    worker.writer.write(encode(Shared.joined(parts)))

    def _account(self, worker: _Worker, report: Report) -> None:
        """Add a worker's finished requests and its counters' growth to the primary's metrics; learn what it
        learned (`take_shared`), and pass that on to the other workers."""
        shared = report.shared
        if shared:
            learn_shared(self.gateway, shared)
            for other in self._workers:
                if other is not worker and other.writer is not None:
                    other.pending.append(shared)
        queued = report.queued
        if queued is not None:
            # Requests waiting in the worker for a deployment's first replica: the autoscaler counts them, and a
            # first one wakes the controller (scale from zero).
            self.gateway.demand_meter.set_queued(f"worker-{worker.row}", queued)
            if queued:
                self.gateway.wake_controller()
        metrics = self.gateway.metrics
        for row in report.requests:
            metrics.record(Accounted._make(row))
        for key, value in report.counters or ():
            grown = value - worker.counters.get(key, 0.0)
            worker.counters[key] = value
            if grown > 0:
                metrics.add_counted(key, grown)

    async def aclose(self) -> None:
        """Stop the workers (SIGTERM: each finishes its requests for up to `server.shutdown_timeout_s`; one still
        running a few seconds later is killed), close the control channel and remove the runtime directory."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._remove_listener is not None:
            self._remove_listener()
        self.begin_shutdown()
        running = [w.process for w in self._workers if w.process is not None]
        deadline = time.monotonic() + self.gateway.settings.server.shutdown_timeout_s + 5.0
        for process in running:
            await asyncio.to_thread(process.join, max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                logger.error("worker pid %s did not stop in time; killing it", process.pid)
                process.kill()
                await asyncio.to_thread(process.join, 5.0)
        if self._server is not None:
            self._server.close()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
