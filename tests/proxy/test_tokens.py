"""Invoke tokens on the client API: required, scoped, expiring, and revocation ending a live stream."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.daemon import Daemon, llama_daemon_with, wait_until
from tests.support.fault_backend import FaultBackend, Trickle
from tests.support.openai_client import openai_client

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def other() -> Iterator[FaultBackend]:
    """The node of the second model, `other`: a fault backend, so a test can script a stream that lasts."""
    with FaultBackend(model="other") as backend:
        yield backend


@pytest.fixture(scope="module")
def token_daemon(
    tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path, llama_server_binary: Path, other: FaultBackend
) -> Iterator[Daemon]:
    """Tokens required; a real llama-server on the tiny model, and the second model on a fault backend."""
    local = [{"id": "llama", "gguf": str(tiny_gguf), "model": "llama", "slots": 2, "threads": 1}]
    env = {"QIIP_AUTH__CLIENT_TOKENS": "required"}
    state_dir = tmp_path_factory.mktemp("token-daemon")
    with llama_daemon_with(state_dir, llama_server_binary, local, env=env) as daemon:
        daemon.add_node("other-node", other.url, "other")
        yield daemon


def new_token(daemon: Daemon, **body: Any) -> dict[str, Any]:
    answer = daemon.admin.post("/admin/tokens", json=body)
    assert answer.status_code == 201, answer.text
    token: dict[str, Any] = answer.json()
    return token


def chat(daemon: Daemon, model: str, secret: str | None, **extra: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {secret}"} if secret else {}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    return httpx.post(daemon.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_requests_without_a_valid_token_are_refused(token_daemon: Daemon) -> None:
    for secret in (None, "qiip_" + "x" * 43, "not-a-token"):
        answer = chat(token_daemon, "llama", secret)
        assert answer.status_code == 401 and answer.headers["www-authenticate"].startswith("Bearer")
        assert answer.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(token_daemon.url + "/health", timeout=30).status_code == 200


def test_a_wrong_token_on_the_models_list_is_counted_like_any_other(token_daemon: Daemon) -> None:
    failures = token_daemon.counter("qiip_auth_failures_total", api="client")
    for path in ("/v1/models", "/v1/models/llama"):
        answer = httpx.get(token_daemon.url + path, headers={"authorization": "Bearer not-a-token"}, timeout=30)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    assert token_daemon.counter("qiip_auth_failures_total", api="client") - failures == 2
    assert "invoke token refused from 127.0.0.1 on /v1/models" in token_daemon.log()


def test_scoped_and_unscoped_tokens(token_daemon: Daemon) -> None:
    scoped = new_token(token_daemon, model="llama", description="ci")
    assert scoped["secret"].startswith("qiip_") and scoped["model"] == "llama"
    assert chat(token_daemon, "llama", scoped["secret"]).status_code == 200
    wrong = chat(token_daemon, "other", scoped["secret"])
    assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "model_not_allowed"
    client = openai_client(token_daemon.url + "/v1", api_key=scoped["secret"])
    assert [m.id for m in client.models.list()] == ["llama"]
    everything = new_token(token_daemon)
    assert chat(token_daemon, "other", everything["secret"]).status_code == 200
    listed = token_daemon.admin.get("/admin/tokens").json()["tokens"]
    assert {t["id"] for t in listed} >= {scoped["id"], everything["id"]}
    assert all("secret" not in t and "secret_hash" not in t for t in listed)
    assert scoped["secret"] not in (token_daemon.state_dir / "tokens.json").read_text()


def test_tokens_expire(token_daemon: Daemon) -> None:
    # Long enough to be used once on a busy machine; then its expiry, as the daemon reads the same clock.
    short = new_token(token_daemon, ttl_s=3.0)
    assert chat(token_daemon, "other", short["secret"]).status_code == 200
    expires_at = datetime.fromisoformat(short["expires_at"])
    wait_until(lambda: datetime.now(UTC) > expires_at, 30, "the token's expiry")
    expired = chat(token_daemon, "other", short["secret"])
    assert expired.status_code == 401 and expired.json()["error"]["code"] in ("token_expired", "token_revoked")


def test_token_limits_and_admin_boundary(token_daemon: Daemon) -> None:
    too_long = token_daemon.admin.post("/admin/tokens", json={"ttl_s": 10**9})
    assert too_long.status_code == 400 and "token_max_ttl_s" in too_long.json()["error"]["message"]
    token = new_token(token_daemon)
    with_bearer = httpx.get(
        token_daemon.url + "/admin/nodes", headers={"authorization": f"Bearer {token['secret']}"}, timeout=30
    )
    assert with_bearer.status_code == 401
    assert token_daemon.admin.delete("/admin/tokens/tok_0000000000000000").status_code == 404


def test_revoking_a_token_ends_its_live_stream(token_daemon: Daemon, other: FaultBackend) -> None:
    token = new_token(token_daemon, model="other")
    # A stream that lasts until the gateway hangs up: it cannot end before the revocation does, however slow.
    other.push(Trickle())
    received: list[str] = []
    first_event = threading.Event()

    def stream() -> None:
        body = {"model": "other", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        headers = {"authorization": f"Bearer {token['secret']}"}
        with httpx.stream(
            "POST", token_daemon.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
        ) as r:
            for line in r.iter_lines():
                received.append(line)
                if line.startswith("data: "):
                    first_event.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert first_event.wait(60)
    revoked = token_daemon.admin.delete(f"/admin/tokens/{token['id']}")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    thread.join(60)
    assert not thread.is_alive()
    events = [line for line in received if line]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "token_revoked"
    other.wait_for_disconnect()  # the node's request closed too
    assert chat(token_daemon, "other", token["secret"]).status_code == 401
