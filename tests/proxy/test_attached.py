"""Attached endpoints: approved existing OpenAI-compatible servers, with a private token file."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qiip_core.engines.llamacpp import LaunchSpec, LlamaServerProcess, free_port
from tests.support.cli import clean_environ
from tests.support.daemon import WAIT_S, Daemon, wait_until
from tests.support.fault_backend import Completion, FaultBackend, Hang, Status
from tests.support.zygote import run_to_end

pytestmark = pytest.mark.integration

SECRET = "attached-node-secret-123"


@pytest.fixture(scope="module")
def keyed_llama(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path, llama_server_binary: Path) -> Iterator[str]:
    """A second real llama-server that requires `Authorization: Bearer <SECRET>`; yields its URL."""
    spec = LaunchSpec(
        model=tiny_gguf,
        alias="keyed",
        port=free_port(),
        ctx_size=2048,
        slots=2,
        threads=1,
        gpu_layers=0,
        extra_args=("--api-key", SECRET),
    )
    log = tmp_path_factory.mktemp("keyed") / "llama.log"
    process = LlamaServerProcess(llama_server_binary, spec, log)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(process.start())
    try:
        # /health is open on llama-server even with an API key.
        loop.run_until_complete(process.wait_ready(60))
        yield process.endpoint
    finally:
        loop.run_until_complete(process.stop())
        loop.close()


def token_file(directory: Path, mode: int = 0o600) -> Path:
    path = directory / "token"
    path.write_text(SECRET + "\n")
    path.chmod(mode)
    return path


def write_config(directory: Path, profiles: str) -> Path:
    config = directory / "qiip.toml"
    config.write_text(profiles)
    return config


@pytest.fixture(scope="module")
def attached_daemon(
    tmp_path_factory: pytest.TempPathFactory, keyed_llama: str
) -> Iterator[tuple[Daemon, FaultBackend]]:
    directory = tmp_path_factory.mktemp("attached")
    fault = FaultBackend(model="fault-model")
    config = write_config(
        directory,
        f"""
[[attached]]
name = "keyed"
url = "{keyed_llama}"
model = "keyed"
concurrency = 1
token_file = "{token_file(directory)}"

[[attached]]
name = "redirecting"
url = "{fault.url}"
model = "fault-model"
concurrency = 1

[[attached]]
name = "lying"
url = "{fault.url}"
model = "not-listed"
attach_on_start = false
""",
    )
    with fault, Daemon(directory / "state", config=config) as daemon:
        daemon.wait_status("keyed", "healthy", timeout_s=30)
        daemon.wait_status("redirecting", "healthy", timeout_s=30)
        yield daemon, fault


def test_requests_reach_the_attached_server_with_its_token(attached_daemon: tuple[Daemon, FaultBackend]) -> None:
    daemon, _ = attached_daemon
    body = {"model": "keyed", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = httpx.post(daemon.url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    node = daemon.admin.get("/admin/nodes/keyed").json()
    assert node["engine"] == "attached" and node["capabilities"]["concurrency"] == 1
    profiles = daemon.admin.get("/admin/attached").json()["attached"]
    assert {p["name"]: p["attached"] for p in profiles} == {"keyed": True, "redirecting": True, "lying": False}
    everything = daemon.admin.get("/admin/nodes").text + daemon.admin.get("/admin/attached").text
    assert SECRET not in everything


def test_concurrency_caps_what_the_router_sends(attached_daemon: tuple[Daemon, FaultBackend]) -> None:
    daemon, fault = attached_daemon
    fault.push(Hang())
    client = httpx.Client(timeout=60)
    body = {"model": "fault-model", "messages": []}
    holder = threading.Thread(target=lambda: _quiet(client, daemon.url, body), daemon=True)
    holder.start()
    try:
        wait_until(lambda: daemon.in_flight("redirecting") == 1, what="one request in flight")
        second = httpx.post(daemon.url + "/v1/chat/completions", json=body, timeout=30)
        assert second.status_code == 503 and second.json()["error"]["code"] == "model_unavailable"
    finally:
        client.close()
        holder.join(60)


def _quiet(client: httpx.Client, url: str, body: dict[str, Any]) -> None:
    try:
        client.post(url + "/v1/chat/completions", json=body)
    except httpx.HTTPError:
        pass


@pytest.mark.parametrize("status", [302, 307, 308])
def test_redirects_are_never_relayed_or_followed(attached_daemon: tuple[Daemon, FaultBackend], status: int) -> None:
    daemon, fault = attached_daemon
    before = sum(r.path == "/v1/chat/completions" for r in fault.requests)
    # The default answer, not a queued one: a breaker's recovery probe may come in between.
    fault.default = Status(status, b"", headers={"Location": "http://10.0.0.1:8000/v1/chat/completions"})
    try:
        answer = httpx.post(
            daemon.url + "/v1/chat/completions", json={"model": "fault-model", "messages": []}, timeout=30
        )
    finally:
        fault.default = Completion()
    assert answer.status_code == 502 and "location" not in answer.headers
    assert "redirect" in answer.json()["error"]["message"] and "10.0.0.1" not in answer.text
    assert sum(r.path == "/v1/chat/completions" for r in fault.requests) == before + 1  # not followed


def test_health_needs_the_model_in_the_server_list(attached_daemon: tuple[Daemon, FaultBackend]) -> None:
    daemon, _ = attached_daemon
    assert daemon.admin.post("/admin/attached/lying", json={}).status_code == 201
    assert daemon.admin.post("/admin/attached/lying", json={}).status_code == 409
    assert daemon.admin.post("/admin/attached/nobody", json={}).status_code == 404
    daemon.wait_status("lying", "unhealthy")
    error = daemon.admin.get("/admin/nodes/lying").json()["last_error"]
    assert "does not list the model 'not-listed'" in error
    removal = daemon.admin.delete("/admin/nodes/lying", params={"force": "true"})
    assert removal.status_code == 202
    daemon.wait_gone("lying")


@pytest.mark.parametrize(
    ("profile", "fragment"),
    [
        ('url = "http://localhost:8000"', "plain http is allowed only to a numeric loopback address"),
        ('url = "https://10.0.0.1:8443/v1"', "takes no path"),
        ('url = "http://127.0.0.1:8000"\ntoken_file = "TOKEN_0644"', "chmod 600"),
        ('url = "http://127.0.0.1:8000"\ntoken_file = "/nonexistent/token"', "cannot be read"),
    ],
)
def test_unsafe_profiles_stop_start_up(tmp_path: Path, profile: str, fragment: str) -> None:
    loose = token_file(tmp_path, 0o644)
    text = f'[[attached]]\nname = "x"\nmodel = "m"\n{profile.replace("TOKEN_0644", str(loose))}\n'
    config = write_config(tmp_path, text)
    env = clean_environ() | {"QIIP_STATE_DIR": str(tmp_path / "state"), "QIIP_ADMIN__ENABLED": "false"}
    result = run_to_end("qiip_proxy", ["--config", str(config), "--port", "1"], env, tmp_path, timeout_s=2 * WAIT_S)
    assert result.returncode == 2 and fragment in result.stderr, result.stderr
    assert SECRET not in result.stderr


@pytest.mark.parametrize(
    ("place", "fragment"),
    [
        ("world-writable", "in a directory others may write in (mode 777)"),
        ("group-writable", "in a directory others may write in (mode 770)"),
        ("link", "must be a regular file, not a link"),
    ],
)
def test_a_token_file_someone_else_could_swap_stops_start_up(tmp_path: Path, place: str, fragment: str) -> None:
    # Anyone who may write in the directory may replace the file between a check and the read; a link may be
    # pointed elsewhere at any time. The file is opened once, without following links, and that is what is checked.
    shared = tmp_path / "shared"
    shared.mkdir()
    private = token_file(shared)
    if place == "link":
        (tmp_path / "token-link").symlink_to(private)
        path = tmp_path / "token-link"
    else:
        shared.chmod(0o777 if place == "world-writable" else 0o770)
        path = private
    config = write_config(
        tmp_path, f'[[attached]]\nname = "x"\nmodel = "m"\nurl = "http://127.0.0.1:8000"\ntoken_file = "{path}"\n'
    )
    env = clean_environ() | {"QIIP_STATE_DIR": str(tmp_path / "state"), "QIIP_ADMIN__ENABLED": "false"}
    result = run_to_end("qiip_proxy", ["--config", str(config), "--port", "1"], env, tmp_path, timeout_s=2 * WAIT_S)
    assert result.returncode == 2 and fragment in result.stderr, result.stderr
    assert SECRET not in result.stderr


def test_an_attached_profile_name_is_reserved_and_its_token_follows_no_name(
    attached_daemon: tuple[Daemon, FaultBackend],
) -> None:
    daemon, fault = attached_daemon
    refused = daemon.admin.post("/admin/nodes", json={"id": "keyed", "endpoint": fault.url, "model": "keyed"})
    assert refused.status_code == 409 and "reserved for the attached profile" in refused.json()["error"]["message"]
    # Look-alike ids at another URL are ordinary nodes, without the token.
    for node_id in ("keyed-2", "Keyed"):
        answer = daemon.admin.post("/admin/nodes", json={"id": node_id, "endpoint": fault.url, "model": "keyed"})
        assert answer.status_code == 201, answer.text
    # The name written straight into the registry (by hand, or another gateway) is ignored.
    daemon.add_node("keyed", fault.url, "keyed", wait=False)
    wait_until(lambda: "reserved for the attached profile" in daemon.log(), what="the reserved id to be refused")
    try:
        for _ in range(6):
            body = {"model": "keyed", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            assert httpx.post(daemon.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        assert any(r.path == "/v1/chat/completions" for r in fault.requests)
        assert not any(SECRET in value for r in fault.requests for value in r.headers.values())
        node = daemon.admin.get("/admin/nodes/keyed").json()
        assert node["engine"] == "attached" and node["endpoint"] != fault.url
    finally:
        for node_id in ("keyed-2", "Keyed"):
            daemon.admin.delete(f"/admin/nodes/{node_id}")
