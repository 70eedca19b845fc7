"""The Python client against a real daemon, and the console's config lookup."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from qiip_core import ConfigError
from qiip_core.client import (
    ApiError,
    DaemonUnreachable,
    QiipClient,
    Unauthorized,
    load_console_config,
)
from tests.support.daemon import Daemon, free_port
from tests.support.fault_backend import FaultBackend, Sse


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, FaultBackend]]:
    with FaultBackend(model="m") as backend, Daemon(tmp_path_factory.mktemp("client")) as running:
        running.add_node("n1", backend.url, "m")
        yield running, backend


def client_for(daemon: Daemon, password: str = "test-password") -> QiipClient:
    return QiipClient(daemon.url, username="admin", password=password)


@pytest.mark.integration
async def test_inventory_lifecycle_and_events(daemon: tuple[Daemon, FaultBackend]) -> None:
    running, _ = daemon
    async with client_for(running) as qiip:
        assert (await qiip.health()).nodes_healthy >= 1
        nodes = await qiip.nodes()
        assert [n.id for n in nodes] == ["n1"] and nodes[0].status == "healthy"
        events = qiip.events(heartbeat_s=0.2)
        first = await anext(events)
        assert first.change == "added" and first.node.id == "n1"
        operation = await qiip.drain("n1", timeout_s=5)
        assert operation.kind == "drain"
        changed = await anext(events)
        assert changed.node.status == "draining"
        await events.aclose()
        await _until_done(qiip, operation.id)
        assert (await qiip.undrain("n1")).id == "n1"
        assert (await qiip.metrics()).keys() == {"by_model", "by_node"}
        with pytest.raises(ApiError) as missing:
            await qiip.node("ghost")
        assert missing.value.status == 404 and missing.value.code == "node_not_found"


async def _until_done(qiip: QiipClient, operation_id: str) -> None:
    async with asyncio.timeout(10):
        while (await qiip.operation(operation_id)).state == "running":  # noqa: ASYNC110 - polling the daemon
            await asyncio.sleep(0.05)


@pytest.mark.integration
async def test_chat_streams_and_cancelling_closes_the_node_request(daemon: tuple[Daemon, FaultBackend]) -> None:
    running, backend = daemon
    running.wait_status("n1", "healthy")
    async with client_for(running) as qiip:
        assert await qiip.models() == ["m"]
        deltas = [d async for d in qiip.chat_stream("m", [{"role": "user", "content": "hi"}])]
        assert "".join(d.content for d in deltas) == "tok0 tok1 tok2 tok3 tok4 "
        # The first piece names the node that answered (X-QIIP-Node); the others do not repeat it.
        assert [d.node for d in deltas] == ["n1"] + [None] * (len(deltas) - 1)
        backend.push(Sse(n_events=1_000, delay_between_s=0.1))  # outlasts any wait for the disconnect
        stream = qiip.chat_stream("m", [{"role": "user", "content": "hi"}])
        assert (await anext(stream)).content
        await stream.aclose()
        backend.wait_for_disconnect()
        with pytest.raises(ApiError) as unknown:
            async for _ in qiip.chat_stream("nope", [{"role": "user", "content": "hi"}]):
                pass
        assert unknown.value.status == 404


@pytest.mark.integration
async def test_failures_are_named(daemon: tuple[Daemon, FaultBackend]) -> None:
    running, _ = daemon
    async with client_for(running, password="wrong") as qiip:
        with pytest.raises(Unauthorized):
            await qiip.nodes()
    async with QiipClient(f"http://127.0.0.1:{free_port()}", username="a", password="b") as nobody:
        with pytest.raises(DaemonUnreachable):
            await nobody.nodes()


def test_console_config_sources(tmp_path: Path) -> None:
    file = tmp_path / "console.toml"
    file.write_text('url = "http://127.0.0.1:9999"\nusername = "ops"\npassword = "pw"\n')
    file.chmod(0o600)
    env = {"QIIP_CONSOLE_CONFIG": str(file)}
    config = load_console_config(env=env)
    assert config.url == "http://127.0.0.1:9999" and config.username == "ops" and config.source == str(file)
    assert config.password is not None and config.password.get_secret_value() == "pw"
    assert "pw" not in repr(config)
    assert load_console_config(url="http://127.0.0.1:1", env=env).url == "http://127.0.0.1:1"
    overridden = load_console_config(env={**env, "QIIP_ADMIN__PASSWORD": "other"})
    assert overridden.password is not None and overridden.password.get_secret_value() == "other"
    assert overridden.source == f"QIIP_ADMIN__PASSWORD and {file}"
    assert load_console_config(env={**env, "QIIP_TOKEN": "t"}).source == str(file)
    both = {**env, "QIIP_ADMIN__USERNAME": "u", "QIIP_ADMIN__PASSWORD": "p"}
    assert load_console_config(env=both).source == "the environment (QIIP_ADMIN__USERNAME and QIIP_ADMIN__PASSWORD)"
    # --url or QIIP_URL naming another daemon: the file's credentials are not sent there.
    elsewhere = load_console_config(url="http://127.0.0.2:9999/", env=env)
    assert elsewhere.url == "http://127.0.0.2:9999" and elsewhere.password is None and elsewhere.username is None
    assert elsewhere.source.startswith(f"nowhere ({file} holds credentials for http://127.0.0.1:9999")
    same = load_console_config(url="http://127.0.0.1:9999/", env=env)
    assert same.password is not None and same.source == str(file)
    from_env = load_console_config(env={**env, "QIIP_URL": "http://127.0.0.2:1", "QIIP_ADMIN__PASSWORD": "p"})
    assert from_env.password is not None and from_env.username is None
    assert from_env.source == "the environment (QIIP_ADMIN__PASSWORD)"
    file.chmod(0o644)
    with pytest.raises(ConfigError) as loose:
        load_console_config(env=env)
    assert "chmod 600" in loose.value.message
    state = tmp_path / "state"
    state.mkdir()
    (state / "console.toml").write_text('url = "http://127.0.0.1:7777"\n')
    (state / "console.toml").chmod(0o600)
    found = load_console_config(env={"XDG_CONFIG_HOME": str(tmp_path / "none")}, state_dir=state)
    assert found.url == "http://127.0.0.1:7777"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("notaurl", "must be http:// or https:// with a host"),
        ("127.0.0.1:8080", "must be http:// or https:// with a host"),
        ("ftp://x", "must be http:// or https:// with a host"),
        ("http://127.0.0.1:8080/v1", "is the OpenAI base URL; give the daemon's own, http://127.0.0.1:8080."),
        ("http://127.0.0.1:8080/?a=1", "must not have a query or a fragment"),
        ("   ", "--url is empty"),
        ("http://[::1", "is not a URL"),
    ],
)
def test_console_urls_are_checked(tmp_path: Path, url: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_console_config(url=url, env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert message in refused.value.message


def test_a_missing_console_config_named_by_the_environment_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as missing:
        load_console_config(env={"QIIP_CONSOLE_CONFIG": str(tmp_path / "nope.toml")})
    assert "QIIP_CONSOLE_CONFIG names" in missing.value.message
