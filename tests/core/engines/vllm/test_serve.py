"""vLLM's command line and the check of a started server, against a real server on loopback answering as vLLM's
OpenAI-compatible server does (`GET /v1/models`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from qiip_core.engines import vllm
from qiip_core.nodes import EndpointPolicy


def vllm_models(*names: str) -> dict[str, Any]:
    """vLLM's list-models answer: the OpenAI list, each entry with vLLM's own fields beside `id`."""
    created = int(time.time())
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": f"/models/{name}",
                "parent": None,
                "max_model_len": 8192,
                "permission": [],
            }
            for name in names
        ],
    }


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, dict[str, web.StreamResponse]]]:
    """A server whose `/v1/models` answers what the test puts under "models"."""
    answers: dict[str, web.StreamResponse] = {}

    async def models(request: web.Request) -> web.StreamResponse:
        return answers["models"]

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", answers
    finally:
        await runner.cleanup()


def test_the_model_goes_after_the_options_end_whatever_it_says() -> None:
    args = vllm.serve_args(host="127.0.0.1", port=8000, alias="chat", model="--trust-remote-code")
    assert args == [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--served-model-name=chat",
        "--",
        "--trust-remote-code",
    ]


def test_the_install_pins_the_configured_release() -> None:
    assert vllm.install_environment(version="0.26.0") == {"QIIPNODE_VLLM_VERSION": "0.26.0"}


async def test_a_server_serving_the_alias_passes(server: tuple[str, dict[str, web.StreamResponse]]) -> None:
    endpoint, answers = server
    answers["models"] = web.json_response(vllm_models("chat"))
    await vllm.check_serves(endpoint, "chat", policy=EndpointPolicy())


async def test_a_server_serving_other_models_fails_naming_five_of_them(
    server: tuple[str, dict[str, web.StreamResponse]],
) -> None:
    endpoint, answers = server
    answers["models"] = web.json_response(vllm_models(*(f"m{i}" for i in range(7))))
    with pytest.raises(vllm.VllmCheckFailed) as refused:
        await vllm.check_serves(endpoint, "chat", policy=EndpointPolicy())
    assert str(refused.value) == "serves 'm0', 'm1', 'm2', 'm3', 'm4' and 2 more, not 'chat'"

    answers["models"] = web.json_response(vllm_models())
    with pytest.raises(vllm.VllmCheckFailed, match=r"^serves no model, not 'chat'$"):
        await vllm.check_serves(endpoint, "chat", policy=EndpointPolicy())


async def test_a_server_without_a_usable_list_fails_saying_why(
    server: tuple[str, dict[str, web.StreamResponse]],
) -> None:
    endpoint, answers = server
    answers["models"] = web.Response(status=404, text="no such route")
    with pytest.raises(vllm.VllmCheckFailed) as refused:
        await vllm.check_serves(endpoint, "chat", policy=EndpointPolicy())
    message = str(refused.value)
    assert message.startswith(f"did not list its models at {endpoint}/v1/models: ") and "404" in message
    assert "\n" not in message
