"""`probe_health` against a real server on loopback: what counts as alive, asked the strict way."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from qiip_core.health import MODELS_BODY_BYTES, ProbeOutcome, health_session, probe_health, probe_models
from qiip_core.nodes import EndpointPolicy
from qiip_core.upstream import describe_client_error

LOADING = b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'


@pytest.fixture
async def node() -> AsyncIterator[tuple[int, dict[str, web.StreamResponse]]]:
    """A server whose `/health` and `/v1/models` answer what the test puts under "health" and "models";
    `/elsewhere` always answers 200."""
    answers: dict[str, web.StreamResponse] = {}

    async def health(request: web.Request) -> web.StreamResponse:
        return answers["health"]

    async def models(request: web.Request) -> web.StreamResponse:
        return answers["models"]

    async def elsewhere(request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/elsewhere", elsewhere)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1], answers
    finally:
        await runner.cleanup()


async def test_a_200_is_alive_and_a_redirect_is_not_even_to_a_200(
    node: tuple[int, dict[str, web.StreamResponse]],
) -> None:
    port, answers = node
    endpoint = f"http://127.0.0.1:{port}"
    async with health_session(policy=EndpointPolicy(), timeout_s=10.0) as session:
        answers["health"] = web.Response(text='{"status":"ok"}')
        ok = await probe_health(endpoint, session=session)
        assert ok.alive and (ok.status, ok.body, ok.error) == (200, b'{"status":"ok"}', None)

        answers["health"] = web.Response(status=302, headers={"Location": f"{endpoint}/elsewhere"})
        moved = await probe_health(endpoint, session=session)
        assert not moved.alive and (moved.outcome, moved.status) == (ProbeOutcome.FAILED, 302)

        answers["health"] = web.Response(status=503, body=LOADING, content_type="application/json")
        loading = await probe_health(endpoint, session=session)
        assert not loading.alive and loading.outcome is ProbeOutcome.LOADING


async def test_no_answer_is_an_answer_with_its_error(node: tuple[int, dict[str, web.StreamResponse]]) -> None:
    port, answers = node
    answers["health"] = web.Response(text="ok")
    # The allowlist resolves host names: with no network allowed, `localhost` leads only to a refused address.
    async with health_session(policy=EndpointPolicy(networks=()), timeout_s=10.0) as session:
        refused = await probe_health(f"http://localhost:{port}", session=session)
    assert (refused.outcome, refused.status) == (ProbeOutcome.FAILED, None)
    assert refused.error is not None and "endpoint allowlist refuses" in describe_client_error(refused.error)


async def test_the_models_listed_are_read_as_strictly_as_health(
    node: tuple[int, dict[str, web.StreamResponse]],
) -> None:
    port, answers = node
    endpoint = f"http://127.0.0.1:{port}"
    async with health_session(policy=EndpointPolicy(), timeout_s=10.0) as session:
        # vLLM's shape: the OpenAI list; an entry without a string id is skipped.
        answers["models"] = web.json_response(
            {"object": "list", "data": [{"id": "qwen", "object": "model"}, {"id": 7}, "x", {"id": "qwen-lora"}]}
        )
        assert await probe_models(endpoint, session=session) == ["qwen", "qwen-lora"]

        refusals = {
            "HTTP 302": web.Response(status=302, headers={"Location": f"{endpoint}/elsewhere"}),
            "HTTP 500": web.Response(status=500),
            "not JSON": web.Response(text="<html>"),
            "that is not JSON": web.Response(text="[" * 100_000),
            "without a `data` list": web.json_response({"data": {"id": "qwen"}}),
            f"over {MODELS_BODY_BYTES} bytes": web.Response(body=b" " * (MODELS_BODY_BYTES + 1)),
        }
        for reason, answer in refusals.items():
            answers["models"] = answer
            with pytest.raises(ValueError, match=reason):
                await probe_models(endpoint, session=session)
    async with health_session(policy=EndpointPolicy(networks=()), timeout_s=10.0) as session:
        with pytest.raises(ValueError, match="no answer"):
            await probe_models(f"http://localhost:{port}", session=session)
