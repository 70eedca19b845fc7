"""Ollama servers as nodes: registered with the CLI or the admin API, watched on Ollama's native routes, served on
its OpenAI-compatible ones through the real `openai` client, against the Ollama stand-in (`tests.support.ollama`)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.support.cli import run_qiip
from tests.support.daemon import Daemon, wait_until
from tests.support.fault_backend import FaultBackend
from tests.support.ollama import LOAD_FAILURE, OllamaStandIn, StandInModel

pytestmark = pytest.mark.integration

SMALL = StandInModel("llama3.2:3b", size_bytes=2_500_000_000, vram_bytes=2_000_000_000, context_length=8192)
BIG = StandInModel("llama3.1:405b", size_bytes=243_000_000_000, loadable=False)


@pytest.fixture(scope="module")
def ollama() -> Iterator[OllamaStandIn]:
    with OllamaStandIn([SMALL, BIG]) as server:
        yield server


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("ollama-daemon")) as running:
        yield running


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def _node(daemon: Daemon, node_id: str) -> dict[str, Any]:
    found = [node for node in daemon.admin.get("/admin/nodes").json()["nodes"] if node["id"] == node_id]
    return found[0] if found else {}


def _register(daemon: Daemon, node_id: str, url: str, model: str) -> None:
    body = {"id": node_id, "endpoint": url, "model": model, "engine": "ollama"}
    answer = daemon.admin.post("/admin/nodes", json=body)
    assert answer.status_code in (200, 201), answer.text


def test_a_node_added_with_the_cli_serves_every_openai_route_and_shows_the_model_it_holds(
    daemon: Daemon, ollama: OllamaStandIn, client: openai.OpenAI
) -> None:
    added = run_qiip(
        daemon.state_dir, "node", "add", "lab-ollama", ollama.url, "--model", SMALL.name, "--engine", "ollama"
    )
    assert added.returncode == 0, added.stderr
    assert added.stdout.strip() == f"registered lab-ollama at {ollama.url} serving '{SMALL.name}' (ollama)"
    daemon.wait_status("lab-ollama", "healthy")
    # Health comes from Ollama's own routes: it has no /health.
    assert ("GET", "/api/version") in ollama.requests and ("GET", "/api/tags") in ollama.requests
    assert ("GET", "/health") not in ollama.requests

    chat = client.chat.completions.with_raw_response.create(
        model=SMALL.name, messages=[{"role": "user", "content": "hello"}]
    )
    assert chat.headers["x-qiip-node"] == "lab-ollama"
    assert chat.parse().choices[0].message.content == ollama.answer
    stream = client.chat.completions.create(
        model=SMALL.name, messages=[{"role": "user", "content": "hello"}], stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == ollama.answer
    assert client.completions.create(model=SMALL.name, prompt="hello").choices[0].text == ollama.answer
    assert len(client.embeddings.create(model=SMALL.name, input=["alpha", "beta"]).data) == 2
    assert SMALL.name in {model.id for model in client.models.list()}

    # What it holds in memory (GET /api/ps), read after the model loaded, in the admin API and /metrics.
    wait_until(lambda: bool(_node(daemon, "lab-ollama").get("resident")), 30, "the resident model")
    (resident,) = _node(daemon, "lab-ollama")["resident"]
    assert resident["name"] == SMALL.name
    assert (resident["size_bytes"], resident["vram_bytes"], resident["context_length"]) == (
        SMALL.size_bytes,
        SMALL.vram_bytes,
        SMALL.context_length,
    )
    assert resident["expires_at"] is not None
    metrics = daemon.metrics()
    vram = rf'^qiip_node_resident_bytes\{{memory="vram",model="{re.escape(SMALL.name)}",node="lab-ollama"\}} (\S+)$'
    match = re.search(vram, metrics, re.M)
    assert match is not None and float(match.group(1)) == SMALL.vram_bytes
    listed = run_qiip(daemon.state_dir, "node", "list")
    assert re.search(rf"lab-ollama\s+{re.escape(ollama.url)}\s+{re.escape(SMALL.name)}\s+ollama", listed.stdout)
    env = {"QIIP_URL": daemon.url, "QIIP_ADMIN__USERNAME": "admin", "QIIP_ADMIN__PASSWORD": "test-password"}
    live = run_qiip(daemon.state_dir, "node", "list", "--live", env=env)
    assert live.returncode == 0, live.stderr
    row = next(line for line in live.stdout.splitlines() if line.startswith("lab-ollama "))
    assert row.split()[:5] == ["lab-ollama", "healthy", "ollama", SMALL.name, "0"]
    assert row.endswith("2.3 GiB (1.9 GiB GPU)")


def test_two_nodes_of_one_server_each_hold_their_own_model_and_a_client_names_it_as_registered(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    other = StandInModel("qwen2.5:14b", size_bytes=10_737_418_240, vram_bytes=7_516_192_768)
    with OllamaStandIn([StandInModel("llama3.2:latest"), other]) as server:
        _register(daemon, "pair-llama", server.url, "llama3.2")  # Ollama's llama3.2:latest
        _register(daemon, "pair-qwen", server.url, other.name)
        daemon.wait_status("pair-llama", "healthy")
        daemon.wait_status("pair-qwen", "healthy")
        client.chat.completions.create(model=other.name, messages=[{"role": "user", "content": "hi"}])
        wait_until(lambda: bool(_node(daemon, "pair-qwen").get("resident")), 30, "qwen's reading")
        wait_until(lambda: _node(daemon, "pair-llama").get("resident") == [], 30, "llama's reading")
        assert [m["name"] for m in _node(daemon, "pair-qwen")["resident"]] == [other.name]
        total = r'^qiip_node_resident_bytes\{memory="total",model="([^"]+)",node="pair-[a-z]+"\}'
        # Once, on its own node: the server's memory is not counted on each of its nodes.
        assert re.findall(total, daemon.metrics(), re.M) == [other.name]
        client.chat.completions.create(model="llama3.2", messages=[{"role": "user", "content": "hi"}])
        wait_until(
            lambda: [m["name"] for m in _node(daemon, "pair-llama")["resident"]] == ["llama3.2:latest"],
            30,
            "llama loaded",
        )
        # Labelled as the node is registered, as the request counters are: the series join on `model`.
        assert sorted(re.findall(total, daemon.metrics(), re.M)) == ["llama3.2", other.name]
    # The server is gone: its nodes are unhealthy, and hold nothing any more (no stale memory on a dead server).
    daemon.wait_status("pair-qwen", "unhealthy")
    assert _node(daemon, "pair-qwen")["resident"] is None
    assert 'node="pair-qwen"' not in daemon.metrics().split("qiip_node_resident_bytes", 1)[-1]
    for node_id in ("pair-llama", "pair-qwen"):
        daemon.admin.delete(f"/admin/nodes/{node_id}")


def test_a_model_the_server_lists_but_cannot_load_gets_the_servers_reason(
    daemon: Daemon, ollama: OllamaStandIn, client: openai.OpenAI
) -> None:
    _register(daemon, "lab-big", ollama.url, BIG.name)
    daemon.wait_status("lab-big", "healthy")  # listed: the server has it
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=BIG.name, messages=[{"role": "user", "content": "hello"}])
    assert refused.value.status_code == 500
    # In the gateway's own words to the client; the node's are the operator's (the admin API and the log).
    assert "the node answered HTTP 500. It lists the model but could not load it into memory." in refused.value.message
    assert LOAD_FAILURE not in refused.value.message
    assert LOAD_FAILURE in (_node(daemon, "lab-big")["last_error"] or "")


@pytest.mark.parametrize(
    ("version", "models", "why"),
    [
        pytest.param("0.5.1", [SMALL], "Ollama 0.5.1 is older than 0.6.0, the oldest release QIIP serves", id="old"),
        pytest.param("0.0.0", [SMALL], "Ollama 0.0.0 is older than 0.6.0", id="development-build"),
        pytest.param("nine", [SMALL], "GET /api/version did not answer an Ollama version", id="not-a-version"),
        pytest.param("0.9.6", [], "GET /api/tags does not list the model 'llama3.2:3b'", id="model-not-listed"),
        pytest.param(
            "0.9.6",
            [StandInModel("llama3.2:1b")],
            "GET /api/tags does not list the model 'llama3.2' (Ollama's 'llama3.2:latest')",
            id="untagged-not-listed",
        ),
    ],
)
def test_a_server_that_is_too_old_or_lacks_the_model_is_unhealthy_and_says_why(
    daemon: Daemon, version: str, models: list[StandInModel], why: str, request: pytest.FixtureRequest
) -> None:
    node_id = f"lab-{request.node.callspec.id}"
    model = "llama3.2" if node_id.endswith("untagged-not-listed") else SMALL.name
    with OllamaStandIn(models, version=version) as server:
        _register(daemon, node_id, server.url, model)
        daemon.wait_status(node_id, "unhealthy")
        assert why in (_node(daemon, node_id)["last_error"] or "")
        assert _node(daemon, node_id)["resident"] is None
    daemon.admin.delete(f"/admin/nodes/{node_id}")


def test_a_server_that_is_not_ollama_is_unhealthy_naming_the_route(daemon: Daemon) -> None:
    with FaultBackend(model=SMALL.name) as other:  # an OpenAI server without Ollama's native routes
        _register(daemon, "lab-not-ollama", other.url, SMALL.name)
        daemon.wait_status("lab-not-ollama", "unhealthy")
        assert "GET /api/version answered 404" in (_node(daemon, "lab-not-ollama")["last_error"] or "")
    daemon.admin.delete("/admin/nodes/lab-not-ollama")
