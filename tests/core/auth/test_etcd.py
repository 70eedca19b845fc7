"""The etcd token store against a real etcd: leases, gateways sharing tokens, outages, hostile values."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import etcd3gw
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
from qiip_core.auth import EtcdTokenStore, InvokeToken, create_token_store
from qiip_core.config import Settings, load_settings
from tests.support.etcd import EtcdServer

pytestmark = pytest.mark.integration

PREFIX = "/tokens/"


def settings_for(etcd: EtcdServer, tmp_path: Path, **auth: object) -> Settings:
    return load_settings(
        state_dir=tmp_path,
        registry={"backend": "etcd"},
        etcd={"endpoints": [etcd.url], "reconnect_max_backoff_s": 0.5, "timeout_s": 2},
        auth=auth,
    )


def raw_client(etcd: EtcdServer) -> Any:
    return etcd3gw.client(host="127.0.0.1", port=etcd.client_port, timeout=5)


def raw_values(etcd: EtcdServer) -> dict[str, bytes]:
    """Every key under the prefix and its value, as etcd holds them."""
    body = {"key": base64.b64encode(b"/tokens/").decode(), "range_end": base64.b64encode(b"/tokens0").decode()}
    client = raw_client(etcd)
    result = client.post(client.get_url("/kv/range"), json=body)
    return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv["value"]) for kv in result.get("kvs", [])}


def lease_of(etcd: EtcdServer, token_id: str) -> tuple[int, int]:
    """(lease id, remaining TTL in seconds) of a token's key."""
    client = raw_client(etcd)
    key = base64.b64encode(f"{PREFIX}{token_id}".encode()).decode()
    kv = client.post(client.get_url("/kv/range"), json={"key": key})["kvs"][0]
    lease = int(kv.get("lease", 0))
    ttl = client.post(client.get_url("/kv/lease/timetolive"), json={"ID": lease})
    return lease, int(ttl["TTL"])


class Revoked:
    def __init__(self) -> None:
        self.ids: list[str] = []

    def __call__(self, token_id: str) -> None:
        self.ids.append(token_id)


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polling what a background task builds
            await asyncio.sleep(0.02)


@pytest.fixture
async def gateways(etcd: EtcdServer, tmp_path: Path) -> AsyncIterator[list[tuple[EtcdTokenStore, Revoked]]]:
    """Two started stores on one etcd: two gateways of a fleet."""
    started: list[tuple[EtcdTokenStore, Revoked]] = []
    for _ in range(2):
        store = EtcdTokenStore(settings_for(etcd, tmp_path))
        revoked = Revoked()
        await store.start(revoked)
        started.append((store, revoked))
    try:
        yield started
    finally:
        for store, _ in started:
            await store.aclose()


def test_the_factory_follows_the_registry_backend(etcd: EtcdServer, tmp_path: Path) -> None:
    assert isinstance(create_token_store(settings_for(etcd, tmp_path)), EtcdTokenStore)


async def test_create_list_authenticate_revoke(
    etcd: EtcdServer, gateways: list[tuple[EtcdTokenStore, Revoked]]
) -> None:
    (store, revoked), _ = gateways
    token, secret = await store.create(model="m", ttl_s=600, description="batch jobs")
    other, other_secret = await store.create(model=None, ttl_s=None)
    assert other.expires_at - other.created_at == timedelta(hours=1)
    assert [t.id for t in await store.list()] == [token.id, other.id]
    assert store.authenticate(secret, model="m") == token
    assert store.status().ok and store.status().live == 2

    # The value is the token without its secret; the key's lease ends just after the token.
    values = raw_values(etcd)
    assert sorted(values) == sorted([f"{PREFIX}{token.id}", f"{PREFIX}{other.id}"])
    for value in values.values():
        for presented in (secret, other_secret):
            assert presented.encode() not in value and presented[8:].encode() not in value
    stored = json.loads(values[f"{PREFIX}{token.id}"])
    assert "id" not in stored and stored["secret_hash"] == token.secret_hash
    lease, ttl = lease_of(etcd, token.id)
    assert lease != 0 and 500 <= ttl <= 602
    assert 3500 <= lease_of(etcd, other.id)[1] <= 3602

    gone = await store.revoke(token.id)
    assert gone.revoked_at is not None and revoked.ids == [token.id]
    assert f"{PREFIX}{token.id}" not in raw_values(etcd)
    with pytest.raises(TokenRevoked) as info:
        store.authenticate(secret, model="m")
    assert secret not in info.value.message
    assert [t.id for t in await store.list()] == [other.id]
    assert await store.revoke(token.id) == gone
    await asyncio.sleep(0.3)
    assert revoked.ids == [token.id]
    with pytest.raises(TokenNotFound):
        await store.revoke("tok_0000000000000000")
    with pytest.raises(TokenInvalid):
        store.authenticate(secret[:-2] + "zz", model="m")


async def test_model_scope(gateways: list[tuple[EtcdTokenStore, Revoked]]) -> None:
    (store, _), (peer, _) = gateways
    bound, bound_secret = await store.create(model="llama", ttl_s=60)
    free, free_secret = await store.create(model=None, ttl_s=60)
    await until(lambda: peer.is_valid(bound.id) and peer.is_valid(free.id))
    for gateway in (store, peer):
        with pytest.raises(TokenScopeError) as info:
            gateway.authenticate(bound_secret, model="qwen")
        assert info.value.status == 403
        assert gateway.authenticate(bound_secret, model="llama").id == bound.id
        assert gateway.authenticate(free_secret, model="qwen").model is None


async def test_expiry_everywhere_and_the_key_leaves_etcd(
    etcd: EtcdServer, gateways: list[tuple[EtcdTokenStore, Revoked]]
) -> None:
    (store, revoked), (peer, peer_revoked) = gateways
    short, secret = await store.create(model="m", ttl_s=1.5)
    long, _ = await store.create(model="m", ttl_s=600)
    await until(lambda: peer.is_valid(short.id))
    await until(lambda: short.id in revoked.ids and short.id in peer_revoked.ids)
    for gateway, ids in ((store, revoked.ids), (peer, peer_revoked.ids)):
        assert ids == [short.id]
        assert not gateway.is_valid(short.id) and gateway.is_valid(long.id)
        with pytest.raises(TokenExpired):
            gateway.authenticate(secret, model="m")
    # The lease removes the key by itself; the delete is taken for the expiry it is, not a revocation.
    await until(lambda: f"{PREFIX}{short.id}" not in raw_values(etcd), timeout_s=20)
    await asyncio.sleep(0.3)
    with pytest.raises(TokenExpired):
        peer.authenticate(secret, model="m")
    assert peer_revoked.ids == [short.id]
    assert [t.id for t in await peer.list()] == [long.id]


async def test_another_gateway_revokes(gateways: list[tuple[EtcdTokenStore, Revoked]]) -> None:
    (store, revoked), (peer, peer_revoked) = gateways
    token, secret = await store.create(model="m", ttl_s=600)
    await until(lambda: peer.is_valid(token.id))
    assert peer.authenticate(secret, model="m") == token
    await peer.revoke(token.id)
    await until(lambda: revoked.ids == [token.id])
    assert not store.is_valid(token.id)
    with pytest.raises(TokenRevoked):
        store.authenticate(secret, model="m")
    assert peer_revoked.ids == [token.id]


async def test_the_cli_creates_and_revokes(
    etcd: EtcdServer, tmp_path: Path, gateways: list[tuple[EtcdTokenStore, Revoked]]
) -> None:
    (store, revoked), _ = gateways
    cli = EtcdTokenStore(settings_for(etcd, tmp_path))
    token, secret = await cli.create(model=None, ttl_s=600)
    await until(lambda: store.is_valid(token.id))
    assert store.authenticate(secret, model="x").id == token.id
    assert [t.id for t in await cli.list()] == [token.id]
    assert (await cli.get(token.id)).id == token.id
    await cli.revoke(token.id)
    await until(lambda: revoked.ids == [token.id])
    with pytest.raises(TokenRevoked):
        store.authenticate(secret, model="x")
    with pytest.raises(TokenNotFound):
        await EtcdTokenStore(settings_for(etcd, tmp_path)).revoke(token.id)


async def test_tokens_survive_a_gateway_restart(etcd: EtcdServer, tmp_path: Path) -> None:
    first = EtcdTokenStore(settings_for(etcd, tmp_path))
    await first.start(Revoked())
    token, secret = await first.create(model="m", ttl_s=600)
    await first.aclose()
    second = EtcdTokenStore(settings_for(etcd, tmp_path))
    revoked = Revoked()
    await second.start(revoked)
    try:
        assert second.authenticate(secret, model="m") == token
        assert [t.id for t in await second.list()] == [token.id]
        assert revoked.ids == []
    finally:
        await second.aclose()


async def test_tokens_survive_an_etcd_restart(etcd: EtcdServer, tmp_path: Path) -> None:
    store = EtcdTokenStore(settings_for(etcd, tmp_path))
    token, secret = await store.create(model="m", ttl_s=600)
    etcd.stop()
    etcd.start()
    fresh = EtcdTokenStore(settings_for(etcd, tmp_path))
    await fresh.start(Revoked())
    try:
        assert fresh.authenticate(secret, model="m").id == token.id
    finally:
        await fresh.aclose()


async def test_an_outage_keeps_the_last_view(
    etcd: EtcdServer, tmp_path: Path, gateways: list[tuple[EtcdTokenStore, Revoked]]
) -> None:
    (store, revoked), _ = gateways
    token, secret = await store.create(model="m", ttl_s=600)
    short, short_secret = await store.create(model="m", ttl_s=2)
    etcd.stop()
    await until(lambda: not store.status().ok)
    assert store.authenticate(secret, model="m").id == token.id
    with pytest.raises(TokenStoreUnavailable) as info:
        await store.create(model="m", ttl_s=60)
    assert info.value.status == 503 and "unreachable" in info.value.message
    with pytest.raises(TokenStoreUnavailable):
        await store.list()
    # Expiry does not wait for etcd.
    await until(lambda: short.id in revoked.ids)
    with pytest.raises(TokenExpired):
        store.authenticate(short_secret, model="m")

    etcd.start()
    await until(lambda: store.status().ok, timeout_s=20)
    cli = EtcdTokenStore(settings_for(etcd, tmp_path))
    await cli.revoke(token.id)
    await until(lambda: token.id in revoked.ids)
    with pytest.raises(TokenRevoked):
        store.authenticate(secret, model="m")


async def test_a_revocation_during_a_lost_watch_is_seen_by_the_snapshot(etcd: EtcdServer, tmp_path: Path) -> None:
    settings = settings_for(etcd, tmp_path)
    store = EtcdTokenStore(settings)
    token, secret = await store.create(model="m", ttl_s=600)
    revoked = Revoked()
    await store.start(revoked)
    try:
        assert store.is_valid(token.id)
        # Revoked while this gateway was not following (it learns of it from its next snapshot).
        raw_client(etcd).delete(f"{PREFIX}{token.id}")
        assert [t.id for t in await store.list()] == []
        assert revoked.ids == [token.id]
        with pytest.raises(TokenRevoked):
            store.authenticate(secret, model="m")
    finally:
        await store.aclose()


async def test_hostile_values_are_skipped(
    etcd: EtcdServer, gateways: list[tuple[EtcdTokenStore, Revoked]], caplog: pytest.LogCaptureFixture
) -> None:
    (store, revoked), (peer, _) = gateways
    token, secret = await store.create(model="m", ttl_s=600)
    good = raw_values(etcd)[f"{PREFIX}{token.id}"]
    client = raw_client(etcd)
    hostile = {
        f"{PREFIX}tok_1111111111111111": b"not json",
        f"{PREFIX}tok_2222222222222222": b"[1, 2]",
        f"{PREFIX}tok_3333333333333333": json.dumps({"model": "m"}).encode(),
        f"{PREFIX}not-an-id": good,
        f"{PREFIX}tok_4444444444444444": b'{"pad": "' + b"x" * 300_000 + b'"}',
    }
    with caplog.at_level(logging.WARNING, logger="qiip.auth"):
        for key, value in hostile.items():
            client.put(key, value)
        client.put(f"{PREFIX}tok_5555555555555555", good)
        # A fresh gateway's snapshot and the running ones' watches skip the same values.
        late = EtcdTokenStore(peer.settings)
        listed = await late.list()
        await until(lambda: caplog.text.count("skipping token tok_4444444444444444") >= 3)
    assert "not JSON" in caplog.text and "not a JSON object" in caplog.text and "over the limit" in caplog.text
    assert sorted(t.id for t in listed) == sorted([token.id, "tok_5555555555555555"])
    # A copy of a token's value under another id carries the same hash: which one is real cannot be told,
    # so the secret opens neither until an operator revokes the copy.
    assert "have the same secret hash" in caplog.text
    for gateway in (store, peer, late):
        with pytest.raises(TokenInvalid):
            gateway.authenticate(secret, model="m")
    await store.revoke("tok_5555555555555555")
    await until(lambda: not peer.is_valid("tok_5555555555555555"))
    for gateway in (store, peer):
        assert gateway.authenticate(secret, model="m").id == token.id
    # A token whose value turns malformed keeps its last valid view (a skip is not a delete).
    client.put(f"{PREFIX}{token.id}", b"garbage")
    await asyncio.sleep(0.3)
    assert store.authenticate(secret, model="m").id == token.id and revoked.ids == ["tok_5555555555555555"]


async def test_old_events_never_overwrite_newer_ones(
    etcd: EtcdServer, gateways: list[tuple[EtcdTokenStore, Revoked]]
) -> None:
    (store, revoked), (peer, _) = gateways
    token, _ = await store.create(model="m", ttl_s=600)
    # The watch delivers the create after this gateway already revoked the token: it must stay revoked.
    await store.revoke(token.id)
    await asyncio.sleep(0.5)
    assert not store.is_valid(token.id) and revoked.ids == [token.id]
    await until(lambda: not peer.is_valid(token.id))
    assert token.id not in [t.id for t in await peer.list()]


async def test_limits_and_prefix_come_from_settings(etcd: EtcdServer, tmp_path: Path) -> None:
    settings = load_settings(
        state_dir=tmp_path,
        registry={"backend": "etcd"},
        etcd={"endpoints": [etcd.url], "tokens_prefix": "/fleet-a/tokens/"},
        auth={"token_default_ttl_s": 30, "token_max_ttl_s": 60},
    )
    store = EtcdTokenStore(settings)
    token, _ = await store.create(model=None, ttl_s=None)
    assert (token.expires_at - token.created_at).total_seconds() == 30
    with pytest.raises(TokenRequestInvalid) as info:
        await store.create(model=None, ttl_s=61)
    assert "auth.token_max_ttl_s" in info.value.message
    assert raw_client(etcd).get(f"/fleet-a/tokens/{token.id}")
    assert raw_values(etcd) == {}
    assert isinstance(InvokeToken.model_validate_json(token.model_dump_json()), InvokeToken)
