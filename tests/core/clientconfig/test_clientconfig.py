"""Client configs: each agent's file parses and gives back the URL, model and key it was made with; the limits
come from the nodes' verified runtimes; bad input is refused; files are written atomically and never clobbered."""

from __future__ import annotations

import json
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from qiip_core import ModelNotFound, NodeNotFound
from qiip_core.clientconfig import (
    DEFAULT_KEY_ENV,
    PLACEHOLDER_KEY,
    ApiKey,
    ClientKind,
    ModelLimits,
    gateway_limits,
    generated_config_path,
    node_limits,
    openai_base_url,
    render_client_config,
    render_target,
    resolve_target,
    write_client_config,
)
from qiip_core.nodes import Engine, LlamaCppRuntime, Node, NodeCapabilities, NodeStatus
from tests.support.client_configs import read_back

BASE = "http://127.0.0.1:8080/v1"


def llama_node(
    node_id: str,
    model: str,
    context_per_slot: int | None,
    *,
    status: NodeStatus = NodeStatus.HEALTHY,
    max_tokens: int | None = None,
) -> Node:
    runtime = None
    if context_per_slot is not None:
        runtime = LlamaCppRuntime(
            requested={"sizing": "auto"},
            effective={"context_per_slot": context_per_slot, "slot_context_limit": context_per_slot * 2, "slots": 2},
            observed_at=datetime(2026, 1, 1, tzinfo=UTC),
        )
    return Node(
        id=node_id,
        endpoint=f"http://127.0.0.1:{9000 + len(node_id)}",
        model=model,
        engine=Engine.LLAMA_CPP if runtime else Engine.VLLM,
        status=status,
        llamacpp_runtime=runtime,
        capabilities=NodeCapabilities(max_tokens=max_tokens),
    )


# -- rendering ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(ClientKind))
@pytest.mark.parametrize("model", ["tiny-chat", "org/name:q4_k_m", "yes", "1.0", "a: b # c"])
def test_every_config_parses_and_gives_back_url_model_and_env_key(kind: ClientKind, model: str) -> None:
    config = render_client_config(
        kind, base_url=BASE, model=model, api_key=ApiKey.from_env(), limits=ModelLimits(4096, 1024)
    )
    assert config.text.endswith("\n")
    back = read_back(kind, config.text, {DEFAULT_KEY_ENV: "qiip_secret"})
    assert (back.base_url, back.model, back.api_key) == (BASE, model, "qiip_secret")
    assert (back.context_tokens, back.max_output_tokens) == (4096, 1024)
    assert "qiip_secret" not in config.text


@pytest.mark.parametrize(
    ("kind", "file_name", "media_type", "parse"),
    [
        (ClientKind.OPENCODE, "opencode.json", "application/json", json.loads),
        (ClientKind.PI, "models.json", "application/json", json.loads),
        (ClientKind.OMP, "models.yaml", "application/yaml", yaml.safe_load),
        (ClientKind.CONTINUE, "config.yaml", "application/yaml", yaml.safe_load),
    ],
)
def test_file_names_and_media_types(kind: ClientKind, file_name: str, media_type: str, parse: Any) -> None:
    config = render_client_config(kind, base_url=BASE, model="m", api_key=ApiKey.placeholder())
    assert (config.client, config.file_name, config.media_type) == (kind, file_name, media_type)
    assert isinstance(parse(config.text), dict)
    assert read_back(kind, config.text).api_key == PLACEHOLDER_KEY


@pytest.mark.parametrize("kind", list(ClientKind))
def test_unknown_limits_are_left_out(kind: ClientKind) -> None:
    config = render_client_config(kind, base_url=BASE, model="m", api_key=ApiKey.literal("k"))
    back = read_back(kind, config.text)
    assert (back.context_tokens, back.max_output_tokens, back.api_key) == (None, None, "k")
    for key in ("limit", "contextWindow", '"maxTokens"', "maxTokens:", "contextLength", "defaultCompletionOptions"):
        assert key not in config.text


def test_opencode_writes_its_limit_only_with_both_numbers() -> None:
    half = render_client_config(
        ClientKind.OPENCODE, base_url=BASE, model="m", api_key=ApiKey.placeholder(), limits=ModelLimits(None, 512)
    )
    assert "limit" not in json.loads(half.text)["provider"]["qiip"]["models"]["m"]
    pi = render_client_config(
        ClientKind.PI, base_url=BASE, model="m", api_key=ApiKey.placeholder(), limits=ModelLimits(None, 512)
    )
    assert read_back(ClientKind.PI, pi.text).max_output_tokens == 512


def test_each_agent_gets_the_key_in_its_own_syntax() -> None:
    texts = {
        kind: render_client_config(kind, base_url=BASE, model="m", api_key=ApiKey.from_env("MY_KEY")).text
        for kind in ClientKind
    }
    assert '"apiKey": "{env:MY_KEY}"' in texts[ClientKind.OPENCODE]
    assert '"apiKey": "MY_KEY"' in texts[ClientKind.PI]
    assert "apiKey: MY_KEY" in texts[ClientKind.OMP]
    assert "${{ secrets.MY_KEY }}" in texts[ClientKind.CONTINUE]
    # Pi and OMP send `max_tokens`, which llama-server and vLLM both read.
    assert json.loads(texts[ClientKind.PI])["providers"]["qiip"]["compat"] == {"maxTokensField": "max_tokens"}


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="must end in /v1"):
        render_client_config(ClientKind.PI, base_url="http://h:1", model="m", api_key=ApiKey.placeholder())
    with pytest.raises(ValueError, match="must not be empty"):
        render_client_config(ClientKind.PI, base_url=BASE, model=" ", api_key=ApiKey.placeholder())
    for kind in (ClientKind.PI, ClientKind.OMP):
        with pytest.raises(ValueError, match="shell command"):
            render_client_config(kind, base_url=BASE, model="m", api_key=ApiKey.literal("!cat /etc/passwd"))
    with pytest.raises(ValueError, match="not an environment variable name"):
        ApiKey.from_env("MY-KEY")
    with pytest.raises(ValueError, match="one non-empty line"):
        ApiKey.literal("a\nb")
    with pytest.raises(ValueError, match="exactly one"):
        ApiKey()
    assert ApiKey.for_gateway(tokens_required=True) == ApiKey.from_env(DEFAULT_KEY_ENV)
    assert ApiKey.for_gateway(tokens_required=False) == ApiKey.placeholder()


def test_openai_base_url() -> None:
    assert openai_base_url("http://127.0.0.1:8080") == BASE
    assert openai_base_url("http://127.0.0.1:8080/") == BASE
    assert openai_base_url("http://127.0.0.1:8080/v1/") == BASE
    assert openai_base_url("https://gw.example/qiip") == "https://gw.example/qiip/v1"
    for bad in ("ftp://h/x", "http://h:1/?a=b", "not a url", "http:///x"):
        with pytest.raises(ValueError):
            openai_base_url(bad)


# -- limits ------------------------------------------------------------------------------------------------


def test_node_limits_come_from_the_verified_runtime() -> None:
    assert node_limits(llama_node("a", "m", 8192)) == ModelLimits(8192, 2048)
    assert node_limits(llama_node("a", "m", 131072)) == ModelLimits(131072, 8192)
    assert node_limits(llama_node("a", "m", 8192, max_tokens=1000)) == ModelLimits(8192, 1000)
    assert node_limits(llama_node("a", "m", None, max_tokens=1000)) == ModelLimits(None, 1000)
    assert node_limits(llama_node("a", "m", None)) == ModelLimits(None, None)


def test_gateway_limits_are_the_smallest_over_healthy_nodes() -> None:
    nodes = [
        llama_node("a", "m", 8192),
        llama_node("b", "m", 4096),
        llama_node("c", "m", 1024, status=NodeStatus.UNHEALTHY),
        llama_node("d", "other", 256),
    ]
    assert gateway_limits(nodes, "m") == ModelLimits(4096, 1024)
    # A healthy node that does not know its window makes the gateway's unknown.
    assert gateway_limits([*nodes, llama_node("e", "m", None)], "m") == ModelLimits(None, None)
    # With no healthy node, every node of the model counts.
    down = [
        llama_node("a", "m", 8192, status=NodeStatus.UNHEALTHY),
        llama_node("b", "m", 2048, status=NodeStatus.DRAINING),
    ]
    assert gateway_limits(down, "m") == ModelLimits(2048, 512)
    assert gateway_limits(nodes, "nothing") == ModelLimits(None, None)


def test_resolve_target_points_at_the_gateway_or_a_node() -> None:
    nodes = [llama_node("a", "m", 8192), llama_node("bb", "m", 4096), llama_node("ccc", "other", 2048)]
    gateway = resolve_target(nodes, model="m", gateway_url="http://gw:8080")
    assert (gateway.base_url, gateway.limits, gateway.provider_id, gateway.node_id) == (
        "http://gw:8080/v1",
        ModelLimits(4096, 1024),
        "qiip",
        None,
    )
    node = resolve_target(nodes, model="m", gateway_url="http://gw:8080", node_id="a")
    assert (node.base_url, node.limits, node.provider_id, node.provider_name) == (
        "http://127.0.0.1:9001/v1",
        ModelLimits(8192, 2048),
        "qiip-a",
        "QIIP node a",
    )
    back = read_back(ClientKind.OPENCODE, render_target(node, ClientKind.OPENCODE, ApiKey.placeholder()).text)
    assert (back.base_url, back.model, back.context_tokens) == ("http://127.0.0.1:9001/v1", "m", 8192)


def test_resolve_target_errors_name_what_exists() -> None:
    nodes = [llama_node("a", "m", 8192), llama_node("ccc", "other", 2048)]
    with pytest.raises(ModelNotFound, match=r"No node serves the model 'x'; the models served: m, other\."):
        resolve_target(nodes, model="x", gateway_url="http://gw:1")
    with pytest.raises(ModelNotFound, match="no node serves any model yet"):
        resolve_target([], model="x", gateway_url="http://gw:1")
    with pytest.raises(NodeNotFound, match=r"No node has the id 'zz'; the nodes serving 'm': a\.") as raised:
        resolve_target(nodes, model="m", gateway_url="http://gw:1", node_id="zz")
    assert raised.value.status == 404 and raised.value.node_id == "zz"
    with pytest.raises(ModelNotFound, match=r"The node ccc serves 'other', not 'm'\."):
        resolve_target(nodes, model="m", gateway_url="http://gw:1", node_id="ccc")


# -- writing -----------------------------------------------------------------------------------------------


def test_write_is_private_and_never_clobbers(tmp_path: Path) -> None:
    config = render_client_config(ClientKind.PI, base_url=BASE, model="m", api_key=ApiKey.literal("qiip_x"))
    written = write_client_config(config, tmp_path)
    assert written == tmp_path / "models.json" and written.read_text() == config.text
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    written.write_text("mine")
    with pytest.raises(FileExistsError, match="--force"):
        write_client_config(config, written)
    assert written.read_text() == "mine"
    assert write_client_config(config, written, force=True).read_text() == config.text
    with pytest.raises(FileNotFoundError, match="create it first"):
        write_client_config(config, tmp_path / "new" / "dir" / "pi.json")
    assert not (tmp_path / "new").exists()
    nested = write_client_config(config, tmp_path / "new" / "dir" / "pi.json", parents=True)
    assert nested.read_text() == config.text
    assert [p.name for p in nested.parent.iterdir()] == ["pi.json"]  # no temporary file left


def test_generated_config_path_is_under_qiips_own_directory(tmp_path: Path) -> None:
    path = generated_config_path(ClientKind.OMP, "org/name:q4", "models.yaml", {"XDG_CONFIG_HOME": str(tmp_path)})
    assert path == tmp_path / "qiip" / "client-configs" / "omp" / "org_name_q4" / "models.yaml"
    assert generated_config_path(ClientKind.PI, "..", "m.json", {"XDG_CONFIG_HOME": "/c"}).parent.name == "model"
