"""The embedded token store: the token file, another process's changes, expiry, restarts, broken files."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path

import pytest

from qiip_core import (
    TokenExpired,
    TokenInvalid,
    TokenNotFound,
    TokenRequestInvalid,
    TokenRevoked,
    TokenScopeError,
    TokenStoreUnavailable,
)
from qiip_core.auth import EmbeddedTokenStore, TokenFile, create_token_store
from qiip_core.config import Settings, load_settings


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return load_settings(state_dir=tmp_path / "state", registry={"poll_interval_s": 0.05})


class Revoked:
    """An `on_revoked` callback that records the ids it is given."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def __call__(self, token_id: str) -> None:
        self.ids.append(token_id)


@pytest.fixture
async def running(settings: Settings) -> AsyncIterator[tuple[EmbeddedTokenStore, Revoked]]:
    store = EmbeddedTokenStore(settings)
    revoked = Revoked()
    await store.start(revoked)
    try:
        yield store, revoked
    finally:
        await store.aclose()


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polling what a background task builds
            await asyncio.sleep(0.02)


def test_the_factory_follows_the_registry_backend(settings: Settings) -> None:
    assert isinstance(create_token_store(settings), EmbeddedTokenStore)


async def test_create_list_authenticate_revoke(running: tuple[EmbeddedTokenStore, Revoked]) -> None:
    store, revoked = running
    token, secret = await store.create(model="m", ttl_s=600, description="CI")
    other, _ = await store.create(model=None, ttl_s=None)
    assert other.expires_at - other.created_at == timedelta(seconds=3600)
    assert [t.id for t in await store.list()] == [token.id, other.id]
    assert store.authenticate(secret, model="m") == token
    assert store.is_valid(token.id) and store.status().ok and store.status().live == 2

    gone = await store.revoke(token.id)
    assert gone.revoked_at is not None and gone.id == token.id
    assert revoked.ids == [token.id]
    assert not store.is_valid(token.id)
    assert [t.id for t in await store.list()] == [other.id]
    assert (await store.get(token.id)).revoked_at == gone.revoked_at
    with pytest.raises(TokenRevoked) as info:
        store.authenticate(secret, model="m")
    assert info.value.token_id == token.id and secret not in info.value.message
    # Revoking again changes nothing and reports nothing new.
    assert await store.revoke(token.id) == gone
    await asyncio.sleep(0.2)
    assert revoked.ids == [token.id]
    with pytest.raises(TokenNotFound):
        await store.revoke("tok_0000000000000000")
    with pytest.raises(TokenNotFound):
        await store.get("tok_0000000000000000")


async def test_the_file_holds_no_secret(settings: Settings, running: tuple[EmbeddedTokenStore, Revoked]) -> None:
    store, _ = running
    secrets = [(await store.create(model="m", ttl_s=60))[1] for _ in range(3)]
    path = settings.state_dir / "tokens.json"
    raw = path.read_text()
    for secret in secrets:
        assert secret not in raw and secret[8:] not in raw and secret[8:24] not in raw
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    doc = json.loads(raw)
    assert doc["version"] == 1 and len(doc["tokens"]) == 3
    fields = {"id", "model", "description", "created_at", "expires_at", "revoked_at", "secret_hash", "secret_prefix"}
    assert all(set(entry) == fields for entry in doc["tokens"])
    assert [p.name for p in settings.state_dir.iterdir() if p.name.endswith(".tmp")] == []


async def test_unknown_and_malformed_secrets(running: tuple[EmbeddedTokenStore, Revoked]) -> None:
    store, _ = running
    _, secret = await store.create(model="m", ttl_s=60)
    forged = secret[:-1] + ("A" if secret[-1] != "A" else "B")
    for presented in (forged, "qiip_" + "x" * 43, "", "Bearer " + secret, secret + " ", "sk-" + secret[3:]):
        with pytest.raises(TokenInvalid) as info:
            store.authenticate(presented, model="m")
        assert secret not in info.value.message and forged not in info.value.message
        assert (info.value.status, info.value.code) == (401, "invalid_api_key")


async def test_model_scope(running: tuple[EmbeddedTokenStore, Revoked]) -> None:
    store, _ = running
    bound, bound_secret = await store.create(model="llama", ttl_s=60)
    _, free_secret = await store.create(model=None, ttl_s=60)
    with pytest.raises(TokenScopeError) as info:
        store.authenticate(bound_secret, model="qwen")
    assert (info.value.status, info.value.model, info.value.token_id) == (403, "qwen", bound.id)
    assert "'llama'" in info.value.message and "'qwen'" in info.value.message
    assert store.authenticate(bound_secret, model="llama").id == bound.id
    assert store.authenticate(bound_secret, model=None).id == bound.id
    for model in ("llama", "qwen", "anything/else"):
        assert store.authenticate(free_secret, model=model).model is None


async def test_expiry_fires_on_revoked(running: tuple[EmbeddedTokenStore, Revoked]) -> None:
    store, revoked = running
    short, secret = await store.create(model="m", ttl_s=1.5)
    long, _ = await store.create(model="m", ttl_s=600)
    assert store.is_valid(short.id)
    await until(lambda: short.id in revoked.ids)
    assert revoked.ids == [short.id]
    assert not store.is_valid(short.id) and store.is_valid(long.id)
    with pytest.raises(TokenExpired) as info:
        store.authenticate(secret, model="m")
    assert info.value.code == "token_expired" and info.value.token_id == short.id
    assert [t.id for t in await store.list()] == [long.id]


async def test_another_process_revokes_and_creates(
    settings: Settings, running: tuple[EmbeddedTokenStore, Revoked]
) -> None:
    store, revoked = running
    token, secret = await store.create(model="m", ttl_s=600)
    # The CLI: a store of its own on the same state directory, never started.
    cli = EmbeddedTokenStore(settings)
    assert [t.id for t in await cli.list()] == [token.id]
    await cli.revoke(token.id)
    await until(lambda: revoked.ids == [token.id])
    assert not store.is_valid(token.id)
    with pytest.raises(TokenRevoked):
        store.authenticate(secret, model="m")

    fresh, fresh_secret = await cli.create(model=None, ttl_s=600)
    await until(lambda: store.is_valid(fresh.id))
    assert store.authenticate(fresh_secret, model="x").id == fresh.id


async def test_tokens_survive_a_restart(settings: Settings) -> None:
    first = EmbeddedTokenStore(settings)
    await first.start(Revoked())
    token, secret = await first.create(model="m", ttl_s=600, description="kept")
    dead, dead_secret = await first.create(model="m", ttl_s=600)
    await first.revoke(dead.id)
    await first.aclose()

    second = EmbeddedTokenStore(settings)
    revoked = Revoked()
    await second.start(revoked)
    try:
        assert second.authenticate(secret, model="m") == token
        with pytest.raises(TokenRevoked):
            second.authenticate(dead_secret, model="m")
        assert [t.description for t in await second.list()] == ["kept"]
        # Tokens already dead when the store starts are not reported as newly revoked.
        await asyncio.sleep(0.3)
        assert revoked.ids == []
    finally:
        await second.aclose()


async def test_ttl_limits_come_from_settings(tmp_path: Path) -> None:
    store = EmbeddedTokenStore(
        load_settings(state_dir=tmp_path, auth={"token_default_ttl_s": 30, "token_max_ttl_s": 120})
    )
    token, _ = await store.create(model=None, ttl_s=None)
    assert token.expires_at - token.created_at == timedelta(seconds=30)
    for ttl_s in (0, -1, 121):
        with pytest.raises(TokenRequestInvalid) as info:
            await store.create(model=None, ttl_s=ttl_s)
        assert "ttl" in info.value.message
    assert "auth.token_max_ttl_s (120 s" in info.value.message
    assert [t.id for t in await store.list()] == [token.id]


async def test_a_broken_file_keeps_the_last_view(
    settings: Settings, running: tuple[EmbeddedTokenStore, Revoked], caplog: pytest.LogCaptureFixture
) -> None:
    store, revoked = running
    token, secret = await store.create(model="m", ttl_s=600)
    path = settings.state_dir / "tokens.json"
    good = path.read_bytes()
    path.write_text("{not json")
    await until(lambda: not store.status().ok)
    assert "move it aside" in store.status().detail
    assert "not a valid QIIP token file" in caplog.text
    # The request path goes on with what it knew; operator actions report the problem.
    assert store.authenticate(secret, model="m").id == token.id
    assert revoked.ids == []
    with pytest.raises(TokenStoreUnavailable) as info:
        await store.list()
    assert str(path) in info.value.message and info.value.status == 503
    with pytest.raises(TokenStoreUnavailable):
        await store.create(model="m", ttl_s=60)
    with pytest.raises(TokenStoreUnavailable):
        await EmbeddedTokenStore(settings).revoke(token.id)
    assert path.read_text() == "{not json"

    path.write_bytes(good)
    await until(lambda: store.status().ok)
    assert store.authenticate(secret, model="m").id == token.id


async def test_a_store_started_on_a_broken_file_refuses_everything(settings: Settings) -> None:
    settings.state_dir.mkdir(parents=True)
    (settings.state_dir / "tokens.json").write_text('{"version": 99, "tokens": []}')
    store = EmbeddedTokenStore(settings)
    await store.start(Revoked())
    try:
        assert not store.status().ok
        with pytest.raises(TokenInvalid):
            store.authenticate("qiip_" + "a" * 43, model="m")
    finally:
        await store.aclose()


async def test_invalid_entries_are_skipped_and_kept(settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    store = EmbeddedTokenStore(settings)
    token, secret = await store.create(model="m", ttl_s=600)
    path = settings.state_dir / "tokens.json"
    doc = json.loads(path.read_text())
    good = doc["tokens"][0]
    doc["tokens"] += [
        {"id": "odd", "model": "m"},
        "not an object",
        {**good, "description": "a duplicate id"},
        {**good, "id": "tok_ffffffffffffffff", "expires_at": "yesterday"},
    ]
    path.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="qiip.auth"):
        assert [t.id for t in await store.list()] == [token.id]
    assert "token entry 'odd' is invalid" in caplog.text and "#2" in caplog.text and "appears twice" in caplog.text
    assert store.authenticate(secret, model="m").description == ""
    # A rewrite keeps what it could not read, for the operator to repair.
    await store.create(model=None, ttl_s=60)
    entries = json.loads(path.read_text())["tokens"]
    assert len(entries) == 6 and "not an object" in entries


async def test_tokens_long_dead_are_dropped_from_the_file(settings: Settings) -> None:
    store = EmbeddedTokenStore(settings)
    old, _ = await store.create(model="m", ttl_s=60)
    path = settings.state_dir / "tokens.json"
    doc = json.loads(path.read_text())
    doc["tokens"][0]["created_at"] = "2020-01-01T00:00:00Z"
    doc["tokens"][0]["expires_at"] = "2020-01-02T00:00:00Z"
    path.write_text(json.dumps(doc))
    kept, _ = await store.create(model="m", ttl_s=60)
    assert [t["id"] for t in json.loads(path.read_text())["tokens"]] == [kept.id]
    assert old.id != kept.id


async def test_a_failing_callback_does_not_stop_the_store(settings: Settings) -> None:
    calls: list[str] = []

    def explode(token_id: str) -> None:
        calls.append(token_id)
        raise RuntimeError("boom")

    store = EmbeddedTokenStore(settings)
    await store.start(explode)
    try:
        first, _ = await store.create(model="m", ttl_s=600)
        second, _ = await store.create(model="m", ttl_s=1.2)
        await store.revoke(first.id)
        await until(lambda: calls == [first.id, second.id])
    finally:
        await store.aclose()


def test_token_file_read_of_a_missing_file(tmp_path: Path) -> None:
    assert TokenFile(tmp_path / "nowhere").read() == {}


def test_an_unusable_state_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(TokenStoreUnavailable) as info:
        TokenFile(blocker / "state").read()
    assert "QIIP_STATE_DIR" in info.value.message
