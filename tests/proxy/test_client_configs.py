"""`GET /chat/config/{client}`: coding-agent configs as downloads, behind the inference API's invoke tokens; each
parses, points at the URL the request came in on, and an `openai` client built from it (the token read from
`QIIP_TOKEN`, as the agent would) reaches the model through the gateway. `qiip client-config` finds the same
token requirement on its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from qiip_cli._main import cli
from qiip_core.clientconfig import DEFAULT_KEY_ENV, ClientKind
from tests.support.client_configs import read_back
from tests.support.daemon import Daemon, llama_daemon_with
from tests.support.fault_backend import FaultBackend
from tests.support.openai_client import openai_client

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def token_fleet(
    tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path, llama_server_binary: Path
) -> Iterator[Daemon]:
    """Invoke tokens required; `tiny-chat` on a local llama.cpp node, `other` on a scripted node."""
    local = [{"id": "chat-a", "gguf": str(tiny_gguf), "model": "tiny-chat", "slots": 2, "threads": 1}]
    env = {"QIIP_AUTH__CLIENT_TOKENS": "required"}
    state_dir = tmp_path_factory.mktemp("client-configs-daemon")
    with (
        FaultBackend(model="other") as other,
        llama_daemon_with(state_dir, llama_server_binary, local, env=env) as daemon,
    ):
        daemon.add_node("other-node", other.url, "other")
        yield daemon


@pytest.fixture(scope="module")
def secret(token_fleet: Daemon) -> str:
    answer = token_fleet.admin.post("/admin/tokens", json={"model": None, "description": "client configs"})
    assert answer.status_code == 201, answer.text
    value: str = answer.json()["secret"]
    return value


def fetch(daemon: Daemon, path: str, secret: str | None, *, base: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {secret}"} if secret else {}
    return httpx.get((base or daemon.url) + path, headers=headers, timeout=30, trust_env=False)


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = response.json()["error"]
    return error


@pytest.mark.parametrize("kind", list(ClientKind))
def test_each_download_reaches_the_model_with_the_token_from_the_environment(
    token_fleet: Daemon, secret: str, kind: ClientKind
) -> None:
    answer = fetch(token_fleet, f"/chat/config/{kind.value}?model=tiny-chat", secret)
    assert answer.status_code == 200, answer.text
    back = read_back(kind, answer.text, {DEFAULT_KEY_ENV: secret})
    file_name = {"opencode": "opencode.json", "pi": "models.json", "omp": "models.yaml", "continue": "config.yaml"}
    assert answer.headers["content-disposition"] == f'attachment; filename="{file_name[kind.value]}"'
    assert answer.headers["content-type"].split(";")[0] in ("application/json", "application/yaml")
    assert secret not in answer.text  # the token is read from the environment, never written
    assert (back.base_url, back.model, back.api_key) == (token_fleet.url + "/v1", "tiny-chat", secret)
    runtime = token_fleet.admin.get("/admin/nodes/chat-a").json()["llamacpp_runtime"]["effective"]
    assert back.context_tokens == runtime["context_per_slot"]
    client = openai_client(back.base_url, api_key=back.api_key)
    raw = client.chat.completions.with_raw_response.create(
        model=back.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert raw.headers["x-qiip-node"] == "chat-a" and raw.parse().choices


def test_the_base_url_is_the_one_the_request_came_in_on(token_fleet: Daemon, secret: str) -> None:
    via_name = f"http://localhost:{token_fleet.port}"
    answer = fetch(token_fleet, "/chat/config/pi?model=tiny-chat", secret, base=via_name)
    assert answer.status_code == 200, answer.text
    assert read_back(ClientKind.PI, answer.text).base_url == via_name + "/v1"


def test_no_token_no_config(token_fleet: Daemon, secret: str) -> None:
    for sent in (None, "qiip_" + "x" * 43):
        refused = fetch(token_fleet, "/chat/config/opencode?model=tiny-chat", sent)
        assert refused.status_code == 401, refused.text
        assert error_of(refused)["code"] == "invalid_api_key"
    scoped = token_fleet.admin.post("/admin/tokens", json={"model": "other"}).json()["secret"]
    wrong_model = fetch(token_fleet, "/chat/config/opencode?model=tiny-chat", scoped)
    assert wrong_model.status_code == 403 and error_of(wrong_model)["code"] == "model_not_allowed"
    assert fetch(token_fleet, "/chat/config/opencode?model=other", scoped).status_code == 200


def test_bad_requests_get_openai_errors(token_fleet: Daemon, secret: str) -> None:
    client = fetch(token_fleet, "/chat/config/vim?model=tiny-chat", secret)
    assert client.status_code == 404
    assert error_of(client)["code"] == "client_not_found"
    assert "the clients: opencode, pi, omp, continue" in error_of(client)["message"]
    model = fetch(token_fleet, "/chat/config/pi?model=nope", secret)
    assert model.status_code == 404
    assert (error_of(model)["code"], error_of(model)["param"]) == ("model_not_found", "model")
    assert "the models served: other, tiny-chat" in error_of(model)["message"]
    missing = fetch(token_fleet, "/chat/config/pi", secret)
    assert missing.status_code == 422 and error_of(missing)["param"] == "model"
    too_long = fetch(token_fleet, "/chat/config/pi?model=" + "m" * 600, secret)
    assert too_long.status_code == 422 and "m" * 600 not in too_long.text


def test_the_cli_finds_that_tokens_are_required(
    token_fleet: Daemon, secret: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QIIP_TOKEN", raising=False)
    env = {
        "QIIP_URL": token_fleet.url,
        "QIIP_ADMIN__USERNAME": "admin",
        "QIIP_ADMIN__PASSWORD": "test-password",
        "QIIP_STATE_DIR": str(tmp_path),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
    }
    result = CliRunner().invoke(cli, ["client-config", "continue", "--model", "tiny-chat"], env=env)
    assert result.exit_code == 0, result.output
    assert f"set {DEFAULT_KEY_ENV} to an invoke token" in result.stderr
    back = read_back(ClientKind.CONTINUE, result.stdout, {DEFAULT_KEY_ENV: secret})
    assert back.api_key == secret
    reply = openai_client(back.base_url, api_key=back.api_key).chat.completions.create(
        model=back.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices
