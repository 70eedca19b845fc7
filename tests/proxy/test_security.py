"""What an unauthenticated client can make the daemon do, through the real daemon with a worker process: no body held
whole on its way to the primary, forwarded headers believed from no one unless configured, one throttle per
credential counting only wrong ones, no forged log lines, JSON bodies bounded before they are parsed, no use by a
web page on another site (content type, `Host`), and an admin password outside ASCII that works."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import select
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.daemon import Daemon, wait_until
from tests.support.fault_backend import FaultBackend
from tests.support.workers import Connections, answer, get, start_with_workers

pytestmark = pytest.mark.integration

PASSWORD = "pässwörd-☃"
"""An admin password outside ASCII: HTTP Basic carries it as UTF-8 (RFC 7617)."""

SECURE_ENV = {
    "QIIP_SERVER__WORKERS": "2",
    "QIIP_AUTH__CLIENT_TOKENS": "required",
    "QIIP_ADMIN__AUTH_FAILURE_BURST": "5",
    "QIIP_ADMIN__PASSWORD": PASSWORD,
    "QIIP_SERVER__MAX_BODY_BYTES": str(8 << 20),
}


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


ADMIN = basic("admin", PASSWORD)
WRONG_ADMIN = basic("admin", "wrong")
WRONG_TOKEN = {"Authorization": "Bearer qiip_" + "x" * 43}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """Two serving processes, invoke tokens required, 5 failures per address, 8 MiB bodies."""
    daemon = Daemon(tmp_path_factory.mktemp("secure"), env=SECURE_ENV)
    try:
        yield start_with_workers(daemon)
    finally:
        daemon.close()


@pytest.fixture(scope="module")
def bearer(daemon: Daemon) -> dict[str, str]:
    """An invoke token for every model."""
    created = daemon.admin.post("/admin/tokens", json={"description": "security tests"})
    assert created.status_code == 201, created.text
    return {"Authorization": f"Bearer {created.json()['secret']}"}


@pytest.fixture
def connections(daemon: Daemon) -> Iterator[Connections]:
    made = Connections(daemon)
    yield made
    made.close()


def test_an_admin_password_outside_ascii_logs_in_through_every_process(
    daemon: Daemon, connections: Connections
) -> None:
    for pid in connections.pids:
        status, _, body = get(connections.on(pid, source="127.0.0.20"), "/admin/nodes", **ADMIN)
        assert status == 200, body


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def queues_empty(sock: socket.socket, server_port: int) -> bool:
    """Whether the bytes sent on `sock` have all been read by the server (both ends' queues empty)."""
    client_port = sock.getsockname()[1]
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        ports = (int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16))
        if ports in ((client_port, server_port), (server_port, client_port)) and fields[4] != "00000000:00000000":
            return False
    return True


def test_a_worker_passes_an_unauthenticated_body_on_without_holding_it(
    daemon: Daemon, connections: Connections
) -> None:
    primary, worker = connections.pids
    warm = connections.on(worker, source="127.0.0.21")
    assert get(warm, "/health")[0] == 200  # the passage to the primary, opened once
    before = {pid: rss_bytes(pid) for pid in connections.pids}
    held = []
    for _ in range(6):
        # Most of a body under the limit (8 MiB) to a path the primary serves, never finished.
        connection = connections.on(worker, source="127.0.0.21")
        assert connection.sock is not None
        connection.sock.sendall(
            b"POST /health HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 7340032\r\n\r\n" + b"x" * (5 << 20)
        )
        held.append(connection.sock)
    wait_until(lambda: all(queues_empty(sock, daemon.port) for sock in held), 60, "the worker to read every byte")
    grown = {pid: rss_bytes(pid) - before[pid] for pid in connections.pids}
    # Held whole, the bodies would take 30 MiB in the worker; streamed, a few chunks per connection.
    assert grown[worker] < 12 << 20, grown
    assert grown[primary] < 12 << 20, grown


def test_failures_of_one_credential_never_throttle_the_other_and_missing_ones_never_count(
    daemon: Daemon, connections: Connections, bearer: dict[str, str]
) -> None:
    worker = connections.pids[1]
    # No credentials at all (the CLI's probe, the chat page's first load): refused, never counted.
    for n in range(12):
        pid = connections.pids[n % 2]
        assert get(connections.on(pid, source="127.0.0.22"), "/admin/nodes")[0] == 401
        assert get(connections.on(pid, source="127.0.0.22"), "/v1/models")[0] == 401
    # Wrong admin passwords: 5, then 429 for the admin API only.
    statuses = [get(connections.on(worker, source="127.0.0.22"), "/admin/nodes", **WRONG_ADMIN)[0] for _ in range(6)]
    assert statuses == [401] * 5 + [429]
    for pid in connections.pids:
        assert get(connections.on(pid, source="127.0.0.22"), "/v1/models", **bearer)[0] == 200
    # The reverse: wrong invoke tokens (counted in the process that saw them), then 429 for the client API only.
    statuses = [get(connections.on(worker, source="127.0.0.23"), "/v1/models", **WRONG_TOKEN)[0] for _ in range(6)]
    assert statuses == [401] * 5 + [429]
    for pid in connections.pids:
        assert get(connections.on(pid, source="127.0.0.23"), "/admin/nodes", **ADMIN)[0] == 200
    wait_until(
        lambda: get(connections.on(connections.pids[0], source="127.0.0.23"), "/v1/models", **bearer)[0] == 429,
        what="the primary to learn the worker's failures",
    )


def test_no_client_value_forges_a_log_line(daemon: Daemon, connections: Connections) -> None:
    forged = "/x%0anode%20n1:%20unhealthy%20->%20healthy%1b[2J%e2%80%a8"
    for pid in connections.pids:
        assert get(connections.on(pid, source="127.0.0.24"), "/admin" + forged, **WRONG_ADMIN)[0] == 401
        # Starlette's routes match no newline; an escape sequence they do.
        terminal = "/x%1b[2J%e2%80%a8"
        assert get(connections.on(pid, source="127.0.0.24"), "/v1/models" + terminal, **WRONG_TOKEN)[0] == 401
    wait_until(lambda: daemon.log().count("from 127.0.0.24") >= 4, what="the failures to be logged")
    log = daemon.log()
    assert "\x1b" not in log and "\u2028" not in log
    assert not [line for line in log.splitlines() if line.startswith("node n1")], log[-2000:]
    assert "/admin/x\\x0anode n1: unhealthy -> healthy\\x1b[2J\\u2028" in log
    assert "/v1/models/x\\x1b[2J\\u2028" in log


ROUTED = {"model_not_found", "no_nodes"}
"""What a parsed request for a model no node serves gets: it went past the parse."""


def post(daemon: Daemon, bearer: dict[str, str], body: bytes, **headers: str) -> httpx.Response:
    headers = {"Content-Type": "application/json", **bearer, **headers}
    return httpx.post(daemon.url + "/v1/chat/completions", content=body, headers=headers, timeout=60)


def test_json_bodies_are_bounded_before_they_are_parsed(daemon: Daemon, bearer: dict[str, str]) -> None:
    def refused(body: bytes) -> str:
        answer = post(daemon, bearer, body)
        assert answer.status_code == 400, answer.text
        code: str = answer.json()["error"]["code"]
        return code

    many = b'{"model": "m", "input": [' + b",".join([b"0"] * 600_000) + b"]}"
    assert refused(many) == "json_too_complex"
    keys = b'{"model": "m", "x": {' + b",".join(b'"k%d": 0' % i for i in range(60_000)) + b"}}"
    assert refused(keys) == "json_too_complex"
    # Nesting is bounded during the parse, by the interpreter's recursion limit.
    assert refused(b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}") == "invalid_json"
    # Within the bounds the body is parsed (and its model looked up): punctuation inside strings does not count.
    text = json.dumps({"model": "nowhere", "messages": [{"role": "user", "content": ', : [ { "' * 400_000}]})
    assert post(daemon, bearer, text.encode()).json()["error"]["code"] in ROUTED
    # As deep as the parser goes, in a message's content (which prefix affinity hashes), in a body large enough to
    # be parsed in a thread (another stack): refused or routed, never an error of the daemon's own.
    for depth in range(900, 1000, 10):
        nested = {"model": "nowhere", "messages": [{"role": "user", "content": "X"}], "pad": "p" * 70_000}
        body = json.dumps(nested).replace('"X"', "[" * depth + "]" * depth).encode()
        assert post(daemon, bearer, body).json()["error"]["code"] in {*ROUTED, "invalid_json"}, depth


def test_health_is_answered_while_hostile_bodies_are_measured(daemon: Daemon, bearer: dict[str, str]) -> None:
    # Bodies that pass every bound at a glance only once their strings are measured, and one past the bounds.
    hostile = [
        json.dumps({"model": "nowhere", "messages": [{"role": "user", "content": ",:" * (3 << 20)}]}).encode(),
        b'{"model": "m", "input": [' + b",".join([b"[]"] * 300_000) + b"]}",
    ] * 2
    codes: list[int] = []

    def send(body: bytes) -> None:
        codes.append(post(daemon, bearer, body).status_code)

    senders = [threading.Thread(target=send, args=(body,)) for body in hostile]
    for sender in senders:
        sender.start()
    health = []
    while True:
        health.append(httpx.get(daemon.url + "/health", timeout=60).status_code)
        if not any(sender.is_alive() for sender in senders):
            break
    for sender in senders:
        sender.join()
    assert sorted(codes) == [400, 400, 503, 503] or sorted(codes) == [400, 400, 404, 404]
    assert set(health) == {200}


def test_a_web_page_cannot_use_the_gateway(
    daemon: Daemon, connections: Connections, bearer: dict[str, str], backends: Callable[..., FaultBackend], model: str
) -> None:
    backend = backends()
    daemon.add_node(f"{model}-n", backend.url, model)
    chat = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    for pid in connections.pids:
        # A form or `text/plain` needs no CORS preflight: refused before the body is read.
        connection = connections.on(pid, source="127.0.0.25")
        connection.request("POST", "/v1/chat/completions", chat, {"Content-Type": "text/plain", **bearer})
        status, _, body = answer(connection)
        assert status == 415 and json.loads(body)["error"]["code"] == "unsupported_media_type"
        # A DNS-rebinding name, on every path.
        for path in ("/v1/chat/completions", "/v1/models", "/health", "/admin/nodes"):
            connection = connections.on(pid, source="127.0.0.25")
            connection.request(
                "POST" if path.endswith("completions") else "GET",
                path,
                chat,
                {"Host": f"rebind.evil.example:{daemon.port}", "Content-Type": "application/json", **bearer},
            )
            status, _, body = answer(connection)
            assert status == 421 and json.loads(body)["error"]["code"] == "host_not_allowed", (pid, path, body)
        # The names the daemon is reached by.
        for host in ("localhost", f"localhost:{daemon.port}", f"127.0.0.1:{daemon.port}", "app.localhost"):
            status, _, _ = get(connections.on(pid, source="127.0.0.25"), "/health", Host=host)
            assert status == 200, host
    assert not [r for r in backend.requests if r.path == "/v1/chat/completions"]
    assert post(daemon, bearer, chat.encode()).status_code == 200


def one_reading_cases(model: str) -> list[tuple[bytes, str]]:
    """Bodies that two JSON parsers may read differently, each with a word of the refusal that names it."""
    chat = '"messages": [{"role": "user", "content": "hi"}]'
    return [
        (f'{{"model": "other", "model": "{model}", {chat}}}'.encode(), "twice"),
        (f'{{"model": "other", "\\u006dodel": "{model}", {chat}}}'.encode(), "twice"),
        (f'{{"model": "{model}", {chat}, "metadata": {{"k": 1, "k": 2}}}}'.encode(), "twice"),
        (f'{{"model": "{model}", "Model": "other", {chat}}}'.encode(), "regard to case"),
        (f'{{"model": "{model}", "\u017ftream": true, {chat}}}'.encode(), "regard to case"),
        (f'{{"model": "{model}", "MAX_TOKENS": 99999999999, {chat}}}'.encode(), "regard to case"),
        (b"\xef\xbb\xbf" + f'{{"model": "{model}", {chat}}}'.encode(), "byte order mark"),
        (f'{{"model": "{model}", {chat}}}'.encode("utf-16"), "NUL"),
        (f'{{"model": "{model}", {chat}}}'.encode("utf-32-le"), "NUL"),
        (f'{{"model": "{model}", {chat}, "user": "\xff"}}'.encode("latin-1"), "not UTF-8"),
        (f'{{"model": "{model}", {chat}, "temperature": NaN}}'.encode(), "NaN"),
        (f'{{"model": "{model}", {chat}, "temperature": -Infinity}}'.encode(), "-Infinity"),
        (f'{{"model": "{model}", {chat}, "temperature": 1e400}}'.encode(), "too large for a double"),
        (f'{{"model": "{model}\\ud800", {chat}}}'.encode(), "surrogate"),
        (f'{{"model": "{model}", "messages": [{{"role": "user", "content": "\\udc00"}}]}}'.encode(), "surrogate"),
        # An escaped backslash between two halves: the halves are no pair.
        (
            f'{{"model": "{model}", "messages": [{{"role": "user", "content": "\\ud800\\\\\\udc00"}}]}}'.encode(),
            "surrogate",
        ),
        (f'{{"model": "{model}", {chat}, "temperature": 1{"0" * 400}}}'.encode(), "too large for a double"),
    ]


def test_a_body_two_parsers_may_read_differently_is_refused_by_every_process(
    daemon: Daemon, connections: Connections, bearer: dict[str, str], backends: Callable[..., FaultBackend], model: str
) -> None:
    backend = backends()
    daemon.add_node(f"{model}-n", backend.url, model)
    cases = one_reading_cases(model)
    for pid in connections.pids:
        for body, named in cases:
            connection = connections.on(pid)
            connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json", **bearer})
            status, _, raw = answer(connection)
            error = json.loads(raw)["error"]
            assert status == 400 and error["code"] == "invalid_json", (pid, body[:60], raw)
            assert named in error["message"], (body[:60], error["message"])
    assert not [r for r in backend.requests if r.path == "/v1/chat/completions"]
    # What these constructs stand for, written once: a surrogate pair escaped, a key of each name in its own object.
    fine = {"model": model, "messages": [{"role": "user", "content": "😀"}], "metadata": {"k": 1, "K": 2}}
    assert post(daemon, bearer, json.dumps(fine).encode()).status_code == 200
    assert backend.requests[-1].body == json.dumps(fine).encode()
    assert "\\ud800" not in daemon.log() and "\ud800" not in daemon.log()


def test_forwarded_headers_are_believed_from_no_one_unless_configured(tmp_path: Path) -> None:
    env = {"QIIP_SERVER__WORKERS": "2", "QIIP_ADMIN__AUTH_FAILURE_BURST": "5"}
    daemon = start_with_workers(Daemon(tmp_path, env=env))
    connections = Connections(daemon)
    try:
        statuses: list[Any] = []
        for n in range(8):
            # From 127.0.0.1, which uvicorn believes by default: each guess claims another client.
            connection = connections.on(connections.pids[n % 2])
            statuses.append(get(connection, "/admin/nodes", **WRONG_ADMIN, **{"X-Forwarded-For": f"10.1.1.{n}"})[0])
        assert statuses == [401] * 5 + [429] * 3
        log = daemon.log()
        assert "admin authentication failed from 127.0.0.1" in log and "10.1.1." not in log
    finally:
        connections.close()
        daemon.close()


def test_the_daemon_believes_forwarded_headers_from_the_addresses_listed(tmp_path: Path) -> None:
    env = {"QIIP_SERVER__WORKERS": "2", "QIIP_SERVER__FORWARDED_ALLOW_IPS": '["127.0.0.0/8"]'}
    daemon = start_with_workers(Daemon(tmp_path, env=env))
    connections = Connections(daemon)
    try:
        for pid in connections.pids:
            connection = connections.on(pid)
            assert get(connection, "/admin/nodes", **WRONG_ADMIN, **{"X-Forwarded-For": "10.2.2.2"})[0] == 401
        wait_until(lambda: daemon.log().count("admin authentication failed from 10.2.2.2") == 2, what="two lines")
    finally:
        connections.close()
        daemon.close()


# -- earlier findings, tested again in every serving process ----------------------------------------------------


def test_a_header_value_that_never_ends_is_refused_by_every_process_with_its_memory_bounded(
    daemon: Daemon, connections: Connections
) -> None:
    """A 64 MiB value dribbled into an unfinished header once grew a process by 115 MiB before its 431."""
    for pid in connections.pids:
        connection = connections.on(pid, source="127.0.0.31")
        sock = connection.sock
        assert sock is not None
        before = rss_bytes(pid)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        sent = 0
        try:
            while sent < 8 << 20 and not select.select([sock], [], [], 0)[0]:
                sock.sendall(b"a" * 16384)
                sent += 16384
        except OSError:
            pass  # the process closed the connection while the value was still coming
        received = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                received += chunk
        assert received.startswith(b"HTTP/1.1 431"), (pid, received[:80])
        assert sent < 8 << 20, "the value was taken in whole"
        assert rss_bytes(pid) - before < 16 << 20, (pid, rss_bytes(pid) - before)


def probe_health(connection: http.client.HTTPConnection, answered: list[int], done: threading.Event) -> None:
    """`GET /health` back to back on `connection` until `done`, each status into `answered`."""
    while not done.is_set():
        answered.append(get(connection, "/health")[0])


def test_a_body_past_the_parse_bounds_is_refused_by_every_process_while_it_keeps_answering(
    daemon: Daemon, connections: Connections, bearer: dict[str, str]
) -> None:
    """Parsing once held the event loop for seconds (29 MiB of keys: /health waited 4.7 s); the work is bounded
    now (`json_too_complex`), and the latency under such bodies is `bench/hostile_bodies.py`'s figure."""
    keys = b"{" + b",".join(b'"k%d":0' % i for i in range(60_000)) + b"}"
    for pid in connections.pids:
        prober = connections.on(pid, source="127.0.0.32")
        hostile = connections.on(pid, source="127.0.0.33")
        answered: list[int] = []
        done = threading.Event()
        thread = threading.Thread(target=probe_health, args=(prober, answered, done))
        thread.start()
        try:
            hostile.request("POST", "/v1/chat/completions", keys, {"Content-Type": "application/json", **bearer})
            status, _, raw = answer(hostile)
        finally:
            done.set()
            thread.join()
        assert status == 400 and json.loads(raw)["error"]["code"] == "json_too_complex", (pid, raw[:200])
        assert answered and set(answered) == {200}, (pid, answered[-5:])


@pytest.mark.parametrize(
    ("variable", "value", "setting"),
    [
        ("QIIP_ATTACHED", '[{"name": "hosted", "url": "https://[fd00:ec2::254]", "model": "m"}]', "attached[0].url"),
        ("QIIP_QUADS__URL", "https://169.254.169.254", "quads.url"),
        ("QIIP_MODELS__HUB_ENDPOINT", "https://[::ffff:169.254.169.254]", "models.hub_endpoint"),
    ],
)
def test_a_daemon_whose_settings_name_a_metadata_address_does_not_start(
    tmp_path: Path, variable: str, value: str, setting: str
) -> None:
    env = {variable: value, **SECURE_ENV}
    if variable == "QIIP_QUADS__URL":
        env["QIIP_QUADS__TIMEZONE"] = "UTC"  # a QUADS URL goes with its server's timezone
    with pytest.raises(RuntimeError, match="the daemon exited with 2") as caught:
        Daemon(tmp_path, env=env).start()
    said = str(caught.value).split("qiip-proxy:", 1)[1]  # what it printed as it refused to start, and nothing else
    assert setting in said and "which QIIP does not connect to" in said and "allowed_endpoint_networks" in said
    assert "Traceback" not in said
