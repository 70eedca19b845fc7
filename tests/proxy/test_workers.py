"""`server.workers = 2` through the real daemon: the primary and its worker both take connections on the one
port. Each test finds which process serves a connection (`/proc`), so what it checks holds in both: the client
API served, everything else passed to the primary, requests in flight counted over both processes (admission,
`/metrics`, drains), every request counted in the primary's metrics, a killed worker started again with its
requests no longer counted, and a stopped daemon taking its workers and its runtime directory with it."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cli import clean_environ
from tests.support.daemon import WAIT_S, Daemon, closed_by_server, wait_until
from tests.support.fault_backend import Completion, FaultBackend, Gated
from tests.support.llama_server import held_llama_server
from tests.support.procnet import children, connections_held
from tests.support.workers import Connections, answer, ask, get, processes, start_with_workers
from tests.support.zygote import run_to_end

pytestmark = pytest.mark.integration

ORIGIN = "https://chat.example.com"
WORKERS_ENV = {
    "QIIP_SERVER__WORKERS": "2",
    "QIIP_ADMISSION__MAX_IN_FLIGHT": "2",
    "QIIP_SERVER__CORS_ALLOW_ORIGINS": f'["{ORIGIN}"]',
    "QIIP_ADMIN__AUTH_FAILURE_BURST": "3",
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon of two serving processes, admitting 2 requests in flight per model."""
    daemon = Daemon(tmp_path_factory.mktemp("workers"), env=WORKERS_ENV)
    try:
        yield start_with_workers(daemon)
    finally:
        daemon.close()


@pytest.fixture
def connections(daemon: Daemon) -> Iterator[Connections]:
    made = Connections(daemon)
    yield made
    made.close()


ADMIN = {"Authorization": "Basic YWRtaW46dGVzdC1wYXNzd29yZA=="}  # admin:test-password (FAST_ENV)


def test_both_processes_serve_the_client_api_and_pass_everything_else_to_the_primary(
    daemon: Daemon, connections: Connections, backends: Callable[..., FaultBackend], model: str
) -> None:
    backend = backends()
    daemon.add_node(f"{model}-n", backend.url, model)
    for pid in connections.pids:
        connection = connections.on(pid)
        ask(connection, model)
        status, headers, _ = answer(connection)
        assert (status, headers["x-qiip-node"]) == (200, f"{model}-n"), pid
        ask(connection, model, stream=True)
        status, _, body = answer(connection)
        assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
        status, _, body = get(connection, "/v1/models")
        assert status == 200 and model in {m["id"] for m in json.loads(body)["data"]}
        status, headers, body = get(connection, "/health", Origin=ORIGIN)
        assert status == 200 and json.loads(body)["nodes_healthy"] >= 1
        # One CORS header, the serving process's, on an answer the primary gave too.
        assert headers["access-control-allow-origin"] == ORIGIN
        status, _, body = get(connection, "/admin/nodes")
        assert status == 401 and json.loads(body)["error"]["code"] == "unauthorized"
        status, _, body = get(connection, "/admin/nodes", **ADMIN)
        assert status == 200 and f"{model}-n" in {n["id"] for n in json.loads(body)["nodes"]}
        status, headers, _ = get(connection, "/chat")
        assert status == 200 and headers["content-type"].startswith("text/html")
        status, _, body = get(connection, "/v1/nowhere")
        assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    # Every request reaches the primary's metrics, whichever process served it.
    wait_until(lambda: daemon.counter("qiip_requests_total", model=model, status="200") == 4, what="4 requests counted")


def test_every_answer_from_either_process_carries_one_date_header(
    daemon: Daemon, connections: Connections, backends: Callable[..., FaultBackend], model: str
) -> None:
    backend = backends()
    daemon.add_node(f"{model}-n", backend.url, model)
    chat = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    requests = [
        ("POST", "/v1/chat/completions", chat, {}),
        ("POST", "/v1/chat/completions", chat.replace('"messages"', '"stream": true, "messages"'), {}),
        ("POST", "/v1/chat/completions", chat.replace(model, "no-such-model"), {}),
        ("GET", "/v1/models", None, {}),
        ("GET", "/health", None, {}),
        ("GET", "/metrics", None, {}),
        ("GET", "/admin/nodes", None, ADMIN),
        ("GET", "/admin/nodes", None, {}),
        ("GET", "/chat", None, {}),
        ("GET", "/nowhere", None, {}),
    ]
    for pid in connections.pids:
        # An address of its own: its one refused login must not count against the other tests' throttle.
        connection = connections.on(pid, source="127.0.0.11")
        for method, path, body, headers in requests:
            connection.request(method, path, body, {"Content-Type": "application/json", **headers})
            response = connection.getresponse()
            response.read()
            dates = [value for name, value in response.getheaders() if name.lower() == "date"]
            assert len(dates) == 1, (pid, method, path, response.status, response.getheaders())
        # An answer of the server itself, before any app: headers over the limit.
        refused = connections.on(pid, source="127.0.0.11")
        assert refused.sock is not None
        refused.sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
        head = refused.sock.makefile("rb").read().split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith(b"http/1.1 431") and head.count(b"\r\ndate: ") == 1, head


def test_failed_logins_are_throttled_per_client_address_over_both_processes(
    daemon: Daemon, connections: Connections
) -> None:
    wrong = {"Authorization": "Basic YWRtaW46d3Jvbmc="}  # admin:wrong
    statuses = []
    for n in range(6):
        connection = connections.on(connections.pids[n % 2], source="127.0.0.7")
        statuses.append(get(connection, "/admin/nodes", **wrong)[0])
    # Three failures from one address, whichever process took them, then 429 from both.
    assert statuses == [401, 401, 401, 429, 429, 429]
    assert "admin authentication failed from 127.0.0.7" in daemon.log()
    assert "from unknown" not in daemon.log()
    # Another address is not held back by it, through either process.
    for pid in connections.pids:
        assert get(connections.on(pid, source="127.0.0.8"), "/admin/nodes", **ADMIN)[0] == 200


def test_an_admin_event_stream_passes_through_a_worker(daemon: Daemon, connections: Connections) -> None:
    connection = connections.on(connections.pids[1])
    connection.request("GET", "/admin/journal?follow=true&heartbeat_s=0.5", headers=ADMIN)
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("content-type", "").startswith("text/event-stream")
    # The entries kept so far (earlier tests' on this module's daemon), or a heartbeat where there are none yet.
    assert response.readline().startswith((b"event: ", b": heartbeat"))
    connection.close()


def hold(
    connections: Connections, backend: FaultBackend, model: str, pids: list[int]
) -> tuple[list[http.client.HTTPConnection], threading.Event]:
    """One request in flight on each process of `pids`, held by the backend until the returned gate opens."""
    gate = threading.Event()
    backend.push(*[Gated(gate, Completion()) for _ in pids])
    held = []
    for pid in pids:
        connection = connections.on(pid)
        ask(connection, model)
        held.append(connection)
    backend.wait_for_requests(len(pids), 10, path="/v1/chat/completions")
    return held, gate


def test_a_malformed_line_on_the_control_channel_is_logged_and_its_connection_dropped(
    daemon: Daemon, connections: Connections, backends: Callable[..., FaultBackend], model: str
) -> None:
    found = re.search(r"runtime directory (\S+)\)", daemon.log())
    assert found is not None
    malformed = (
        (b"not json\n", "Invalid JSON"),
        (b'{"kind": "ready"}\n', "not its greeting"),
        # A greeting for the worker's row from another process (this one) would take the worker's fleet away.
        (b'{"kind": "hello", "row": 1}\n', f"a greeting for worker 1 came from pid {os.getpid()}"),
    )
    for line, why in malformed:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as control:
            control.settimeout(30)
            control.connect(str(Path(found.group(1)) / "control.sock"))
            control.sendall(line)
            assert control.recv(1) == b""  # dropped by the primary
        wait_until(lambda: why in daemon.log(), what="the malformed line to be logged")  # noqa: B023
    assert "a worker's control connection failed: a malformed control message" in daemon.log()
    # Both processes serve on, and the worker still follows the fleet: a node added now is routed by it too.
    backend = backends()
    daemon.add_node(f"{model}-n", backend.url, model)
    for pid in connections.pids:
        connection = connections.on(pid)
        ask(connection, model)
        assert answer(connection)[0] == 200, pid


def test_requests_in_flight_are_counted_over_both_processes(
    daemon: Daemon, connections: Connections, backends: Callable[..., FaultBackend], model: str
) -> None:
    backend = backends()
    daemon.add_node(f"{model}-n", backend.url, model)
    held, gate = hold(connections, backend, model, connections.pids)
    try:
        # Each process holds one request: the bound of 2 is reached only over both.
        wait_until(lambda: daemon.in_flight(f"{model}-n") == 2, what="2 requests in flight")
        for pid in connections.pids:
            connection = connections.on(pid)
            ask(connection, model)
            status, headers, body = answer(connection)
            assert status == 429 and json.loads(body)["error"]["code"] == "model_overloaded", pid
            assert "2 requests are in flight" in json.loads(body)["error"]["message"]
    finally:
        gate.set()
    assert [answer(connection)[0] for connection in held] == [200, 200]
    wait_until(lambda: daemon.in_flight(f"{model}-n") == 0, what="no request in flight")
    wait_until(lambda: daemon.counter("qiip_requests_total", model=model, status="429") == 2, what="2 shed counted")
    assert daemon.counter("qiip_requests_shed_total", model=model) == 2


def test_a_drained_node_gets_nothing_from_either_process(
    daemon: Daemon, connections: Connections, backends: Callable[..., FaultBackend], model: str
) -> None:
    first, second = backends(), backends()
    daemon.add_node(f"{model}-a", first.url, model)
    daemon.add_node(f"{model}-b", second.url, model)
    drained = daemon.admin.post(f"/admin/nodes/{model}-a/drain", json={"timeout_s": 5})
    assert drained.status_code == 202
    daemon.wait_status(f"{model}-a", "draining")
    try:
        for pid in connections.pids:
            connection = connections.on(pid)
            for _ in range(4):
                ask(connection, model)
                status, headers, _ = answer(connection)
                assert (status, headers["x-qiip-node"]) == (200, f"{model}-b"), pid
    finally:
        assert daemon.admin.post(f"/admin/nodes/{model}-a/undrain", json={}).status_code == 200


def test_a_killed_worker_is_started_again_and_its_requests_stop_counting(
    daemon: Daemon, connections: Connections, backends: Callable[..., FaultBackend], model: str
) -> None:
    backend = backends()
    daemon.add_node(f"{model}-n", backend.url, model)
    primary, worker = connections.pids
    held, gate = hold(connections, backend, model, [worker])
    wait_until(lambda: daemon.in_flight(f"{model}-n") == 1, what="1 request in flight")
    os.kill(worker, signal.SIGKILL)

    def counted() -> float | None:
        # The test client's pooled connection to the killed worker is reset: that read says nothing yet.
        try:
            return daemon.in_flight(f"{model}-n")
        except httpx.TransportError:
            return None

    try:
        # Its request died with it: the board row is zeroed, and a new worker takes its place.
        wait_until(lambda: counted() == 0, what="the dead worker's request to stop counting")
        wait_until(lambda: len(processes(daemon)) == 2 and worker not in processes(daemon), what="a new worker")
        wait_until(lambda: daemon.log().count("worker 1 serving") >= 2, 2 * WAIT_S, "the new worker to serve")
    finally:
        gate.set()
    assert re.search(r"worker 1 exited \(status -9\)", daemon.log())
    renewed = Connections(daemon)
    try:
        connection = renewed.on(renewed.pids[1])
        ask(connection, model)
        assert answer(connection)[0] == 200
    finally:
        renewed.close()
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        answer(held[0])


def test_a_worker_that_falls_silent_is_killed_and_replaced_and_its_requests_released(
    daemon: Daemon, connections: Connections, backends: Callable[..., FaultBackend], model: str
) -> None:
    backend = backends()
    daemon.add_node(f"{model}-n", backend.url, model)
    primary, worker = connections.pids
    held, gate = hold(connections, backend, model, [worker])
    wait_until(lambda: daemon.in_flight(f"{model}-n") == 1, what="1 request in flight")
    started = daemon.log().count("worker 1 serving")
    os.kill(worker, signal.SIGSTOP)

    def released() -> bool:
        try:
            return daemon.in_flight(f"{model}-n") == 0
        except httpx.HTTPError:
            return False  # the test's own connection was the stopped worker's

    try:
        # Alive but silent: its request would count for ever. It is killed, and its request stops counting.
        wait_until(released, 30, "the silent worker's request to stop counting")
        wait_until(lambda: daemon.log().count("worker 1 serving") > started, 2 * WAIT_S, "a new worker to serve")
    finally:
        gate.set()
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)
    log = daemon.log()
    assert re.search(rf"worker 1 \(pid {worker}\) has said nothing for \d+\.\d s \(stopped", log), log
    assert "worker 1 exited (status -9)" in log and "1 request(s) it had in flight released" in log
    renewed = Connections(daemon)
    try:
        connection = renewed.on(renewed.pids[1])
        ask(connection, model)
        assert answer(connection)[0] == 200
    finally:
        renewed.close()


def test_a_local_model_answers_503_from_every_process_until_its_node_is_registered(
    tmp_path: Path, tiny_gguf: Path, llama_server_binary: Path
) -> None:
    # llama-server held at its start until the gate opens: the model loading, as long as the test wants.
    held, gate = held_llama_server(tmp_path, llama_server_binary)
    local = [{"id": "local-a", "gguf": str(tiny_gguf), "model": "tiny-local", "slots": 1, "threads": 1}]
    env = {**WORKERS_ENV, "QIIP_LOCAL_NODES": json.dumps(local), "QIIP_ENGINES__LLAMACPP__SERVER_BINARY": str(held)}
    daemon = start_with_workers(Daemon(tmp_path / "daemon", env=env))
    connections = Connections(daemon)
    try:
        health = daemon.client.get("/health").json()
        assert health["status"] == "starting" and health["local_nodes"] == {"local-a": "starting"}
        for pid in connections.pids:
            connection = connections.on(pid)
            ask(connection, "tiny-local")
            status, headers, body = answer(connection)
            error = json.loads(body)["error"]
            assert (status, error["code"], headers.get("retry-after")) == (503, "model_unavailable", "5"), pid
            assert "its local node local-a is starting" in error["message"]
            assert get(connection, "/v1/models/tiny-local")[0] == 503
            ask(connection, "no-such-model")
            status, _, body = answer(connection)
            assert (status, json.loads(body)["error"]["code"]) == (503, "no_nodes")  # no node registered at all
        gate.touch()
        daemon.wait_status("local-a", "healthy", timeout_s=60)
        for pid in connections.pids:
            connection = connections.on(pid)
            ask(connection, "tiny-local", max_tokens=2)
            assert answer(connection)[0] == 200, pid
        assert daemon.client.get("/health").json()["status"] == "ok"
    finally:
        gate.touch()
        connections.close()
        daemon.close()


def test_silent_connections_take_no_more_than_the_cap_in_either_process_and_never_keep_admin_out(
    tmp_path: Path,
) -> None:
    daemon = start_with_workers(Daemon(tmp_path, env={**WORKERS_ENV, "QIIP_SERVER__MAX_CLIENT_CONNECTIONS": "8"}))
    silent: list[socket.socket] = []
    try:
        pids = processes(daemon)
        # Sixty sockets that never send a byte, from five addresses: far more than both processes' caps together.
        for n in range(60):
            address = (f"127.0.0.{2 + n % 5}", 0)
            silent.append(socket.create_connection(("127.0.0.1", daemon.port), timeout=10, source_address=address))

        def settled() -> bool:
            held = [connections_held(pid, daemon.port) for pid in pids]
            return sum(held) + sum(closed_by_server(sock) for sock in silent) == 60

        # Every one accepted: each process closed the ones silent longest to stay at its cap.
        wait_until(settled, what="every silent connection to be accepted, and the oldest closed")
        assert all(connections_held(pid, daemon.port) <= 8 for pid in pids)
        # A client with something to ask gets in, in either process.
        connections = Connections(daemon)
        try:
            for pid in connections.pids:
                status, _, body = get(connections.on(pid, source="127.0.0.7"), "/admin/nodes", **ADMIN)
                assert status == 200, (pid, body)
        finally:
            connections.close()
        assert all(connections_held(pid, daemon.port) <= 8 for pid in pids)
        assert "at the cap of 8 client connections: " in daemon.log()
    finally:
        for sock in silent:
            sock.close()
        daemon.close()


def test_a_stopped_daemon_stops_its_workers_and_removes_its_runtime_directory(tmp_path: Path) -> None:
    daemon = start_with_workers(Daemon(tmp_path, env=WORKERS_ENV))
    try:
        pids = processes(daemon)
        found = re.search(r"runtime directory (\S+)\)", daemon.log())
        assert found is not None and Path(found.group(1)).is_dir()
        runtime_dir = Path(found.group(1))
        assert {p.name for p in runtime_dir.iterdir()} == {"admin.sock", "control.sock", "in-flight.board"}
        assert daemon.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
        assert not any(Path(f"/proc/{pid}").exists() and pid in children(pids[0]) for pid in pids[1:])
        assert not runtime_dir.exists()
    finally:
        daemon.close()


@pytest.mark.parametrize("workers", ["0", "9", "many"])
def test_a_worker_count_out_of_range_stops_start_up_with_a_message(tmp_path: Path, workers: str) -> None:
    env = clean_environ() | {"QIIP_STATE_DIR": str(tmp_path), "QIIP_SERVER__WORKERS": workers}
    done = run_to_end("qiip_proxy", ["--port", "1"], env, tmp_path, timeout_s=2 * WAIT_S)
    assert done.returncode == 2
    assert "server.workers" in done.stderr


def test_workers_whose_primary_was_killed_shut_down(tmp_path: Path) -> None:
    daemon = start_with_workers(Daemon(tmp_path, env=WORKERS_ENV))
    try:
        worker = processes(daemon)[1]
        found = re.search(r"runtime directory (\S+)\)", daemon.log())
        assert found is not None
        assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL
        wait_until(lambda: not Path(f"/proc/{worker}").exists(), 30, "the orphaned worker to exit")
        # The worker removed the runtime directory its primary could not.
        assert not Path(found.group(1)).exists()
    finally:
        daemon.close()


def test_on_sigterm_every_process_stops_accepting_at_once_and_finishes_its_requests(
    tmp_path: Path, backends: Callable[..., FaultBackend], model: str
) -> None:
    daemon = start_with_workers(Daemon(tmp_path, env={**WORKERS_ENV, "QIIP_SERVER__SHUTDOWN_TIMEOUT_S": "20"}))
    connections = Connections(daemon)
    try:
        backend = backends()
        daemon.add_node(f"{model}-n", backend.url, model)
        held, gate = hold(connections, backend, model, [connections.pids[1]])
        assert daemon.process is not None
        daemon.process.send_signal(signal.SIGTERM)

        def refused() -> bool:
            probe = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=2)
            try:
                probe.connect()
            except ConnectionRefusedError:
                return True
            finally:
                probe.close()
            return False

        # The port closes in both processes long before the 20 s grace ends, while the worker's request runs on.
        wait_until(refused, what="the port to close")
        gate.set()
        status, _, _ = answer(held[0])
        assert status == 200
        assert daemon.process.wait(30) in (0, -signal.SIGTERM)
    finally:
        connections.close()
        daemon.close()


def test_at_the_end_of_the_grace_uploads_and_waiting_requests_end_quietly_in_every_process(
    tmp_path: Path, backends: Callable[..., FaultBackend], model: str
) -> None:
    daemon = start_with_workers(Daemon(tmp_path, env={**WORKERS_ENV, "QIIP_SERVER__SHUTDOWN_TIMEOUT_S": "1"}))
    connections = Connections(daemon)
    try:
        backend = backends()
        daemon.add_node(f"{model}-n", backend.url, model)
        waiting, gate = hold(connections, backend, model, connections.pids)
        uploads = []
        for pid in connections.pids:
            for path in ("/v1/chat/completions", "/admin/nodes"):
                upload = connections.on(pid)
                upload.putrequest("POST", path)
                for name, value in {**ADMIN, "Content-Type": "application/json", "Content-Length": "30000"}.items():
                    upload.putheader(name, value)
                upload.endheaders(b'{"model": "' + model.encode() + b'", "messages": [')
                uploads.append(upload)
        assert daemon.process is not None
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.process.wait(60) in (0, -signal.SIGTERM)
        gate.set()
        for connection in waiting:
            status, _, body = answer(connection)
            assert (status, json.loads(body)["error"]["code"]) == (503, "gateway_shutdown")
        log = daemon.log()
        assert "Traceback" not in log, log
        # Each process ends the uploads it still receives (an upload a worker streams on to the primary ends in
        # whichever process's grace ends first).
        ended = [int(n) for n in re.findall(r"shutdown: (\d+) request\(s\) still sending their body after 1 s", log)]
        assert len(ended) == 2 and sum(ended) >= 3, log
    finally:
        connections.close()
        daemon.close()


def test_a_sigint_during_the_grace_forces_the_stop_of_every_process(
    tmp_path: Path, backends: Callable[..., FaultBackend], model: str
) -> None:
    # A grace far longer than the test waits: only the forced stop ends the requests held in both processes.
    daemon = start_with_workers(Daemon(tmp_path, env={**WORKERS_ENV, "QIIP_SERVER__SHUTDOWN_TIMEOUT_S": "3600"}))
    connections = Connections(daemon)
    try:
        backend = backends()
        daemon.add_node(f"{model}-n", backend.url, model)
        held, gate = hold(connections, backend, model, connections.pids)
        assert daemon.process is not None
        daemon.process.send_signal(signal.SIGTERM)
        wait_until(
            lambda: daemon.log().count("Waiting for connections to close") == 2, what="both processes' graceful stop"
        )
        daemon.process.send_signal(signal.SIGINT)  # to the primary only: it forces its workers' stop too
        daemon.process.wait(120)
        gate.set()
        for connection in held:
            status, _, body = answer(connection)
            assert (status, json.loads(body)["error"]["code"]) == (503, "gateway_shutdown")
        log = daemon.log()
        assert log.count("shutdown forced (a second SIGINT)") == 2 and "Traceback" not in log, log
    finally:
        connections.close()
        daemon.close()


def test_ctrl_c_stops_every_process_without_a_traceback(tmp_path: Path) -> None:
    daemon = start_with_workers(Daemon(tmp_path, env=WORKERS_ENV))
    try:
        # Ctrl-C in a terminal signals the whole process group.
        for pid in processes(daemon):
            os.kill(pid, signal.SIGINT)
        assert daemon.process is not None
        daemon.process.wait(30)
        assert "Traceback" not in daemon.log()
    finally:
        daemon.close()


def test_tokens_created_or_revoked_and_failures_reach_every_process(tmp_path: Path) -> None:
    env = {
        **WORKERS_ENV,
        "QIIP_AUTH__CLIENT_TOKENS": "required",
        # The token store's own poll is slow: the primary tells the worker at once.
        "QIIP_REGISTRY__POLL_INTERVAL_S": "30",
    }
    daemon = start_with_workers(Daemon(tmp_path, env=env))
    connections = Connections(daemon)
    try:
        created = daemon.admin.post("/admin/tokens", json={"description": "workers"})
        assert created.status_code == 201
        bearer = {"Authorization": f"Bearer {created.json()['secret']}"}
        wait_until(
            lambda: get(connections.on(connections.pids[1]), "/v1/models", **bearer)[0] == 200, 5, "the token to work"
        )
        assert daemon.admin.delete(f"/admin/tokens/{created.json()['id']}").status_code == 200
        wait_until(
            lambda: get(connections.on(connections.pids[1]), "/v1/models", **bearer)[0] == 401, 5, "the token to stop"
        )
        # Wrong tokens from one address count over both processes: 3 (the burst), then 429 from either.
        wrong = {"Authorization": "Bearer qiip_" + "x" * 43}
        statuses = []
        for n in range(6):
            statuses.append(get(connections.on(connections.pids[n % 2], source="127.0.0.9"), "/v1/models", **wrong)[0])
            time.sleep(0.3)  # a failure reaches the other process within 0.2 s
        assert statuses == [401, 401, 401, 429, 429, 429]
    finally:
        connections.close()
        daemon.close()
