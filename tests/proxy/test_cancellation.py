"""A client that goes away closes the node's request and frees its reservation; a daemon that stops ends its
streams honestly and quietly."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.daemon import Daemon, wait_until
from tests.support.fault_backend import FaultBackend, Hang, Json, Sse

pytestmark = pytest.mark.integration

Backends = Callable[..., FaultBackend]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def patient_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose limits on a node's answer are far longer than any test takes, so only the client leaving
    ends a request, however slow the machine."""
    env = {
        "QIIP_HEALTH__INTERVAL_S": "60",
        "QIIP_UPSTREAM__TTFB_TIMEOUT_S": "600",
        "QIIP_UPSTREAM__GENERATION_TIMEOUT_S": "600",
        "QIIP_UPSTREAM__IDLE_TIMEOUT_S": "600",
    }
    with Daemon(tmp_path_factory.mktemp("patient-daemon"), env=env) as daemon:
        yield daemon


def send_raw(daemon: Daemon, model: str, *, stream: bool) -> socket.socket:
    body = b'{"model": "%s", "messages": [], "stream": %s}' % (model.encode(), b"true" if stream else b"false")
    sock = socket.create_connection(("127.0.0.1", daemon.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    return sock


@pytest.mark.parametrize(
    ("behaviour", "stream", "read_first"),
    [
        (Hang(), True, False),
        (Hang(), False, False),
        (Sse(n_events=100, delay_between_s=1), True, True),
        (Json(200, {"late": True}, delay_s=600), False, False),
    ],
    ids=["waiting-for-first-token", "waiting-non-streaming", "mid-stream", "slow-json"],
)
def test_client_disconnect_reaches_the_node(
    patient_daemon: Daemon, backends: Backends, model: str, behaviour: object, stream: bool, read_first: bool
) -> None:
    backend = backends()
    backend.default = behaviour  # type: ignore[assignment]
    node_id = f"{model}-n"
    patient_daemon.add_node(node_id, backend.url, model)
    sock = send_raw(patient_daemon, model, stream=stream)
    record = backend.wait_for_requests(1, path="/v1/chat/completions")[0]
    if read_first:
        received = b""
        while b"data: " not in received:
            piece = sock.recv(65536)
            assert piece, received
            received += piece
    wait_until(lambda: patient_daemon.in_flight(node_id) == 1, what="the request to be in flight")
    left_at = time.monotonic()
    sock.close()
    seen_at = backend.wait_for_disconnect()
    assert record.received_at < left_at < seen_at  # the node's request ended because the client left
    wait_until(lambda: patient_daemon.in_flight(node_id) == 0, what="the reservation to be released")
    assert patient_daemon.node_statuses()[node_id] == "healthy"
    assert patient_daemon.counter("qiip_request_errors_total", model=model, code="client_disconnected") == 1


def test_a_stream_ended_by_the_shutdown_grace_period_is_one_quiet_line(
    tmp_path: Path, backends: Callable[..., FaultBackend], model: str
) -> None:
    backend = backends()
    backend.default = Sse(n_events=3, delay_between_s=60)
    daemon = Daemon(tmp_path, env={"QIIP_SERVER__SHUTDOWN_TIMEOUT_S": "1", "QIIP_HEALTH__INTERVAL_S": "60"})
    with daemon:
        daemon.add_node(f"{model}-n", backend.url, model)
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.Client(timeout=30) as client, client.stream("POST", daemon.url + CHAT, json=body) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")
            stopper = threading.Thread(target=daemon.stop)
            stopper.start()
            rest = [line for line in lines if line]
            stopper.join(30)
    assert '"code": "gateway_shutdown"' in rest[-2] and rest[-1] == "data: [DONE]"
    log = daemon.log()
    assert "Exception in ASGI application" not in log and "Traceback" not in log
    assert log.count("ended: the daemon stopped (its shutdown grace period ran out, or the stop was forced)") == 1
    # The end of the grace is expected: a warning that says so, not uvicorn's error line.
    assert "timeout graceful shutdown exceeded" not in log
    assert log.count("shutdown: 1 request(s) still open after 1 s were ended") == 1
