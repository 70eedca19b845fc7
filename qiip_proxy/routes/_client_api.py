"""The OpenAI-compatible client API as FastAPI routes: `/v1/models`, `/health`, and the documented
inference routes, which run `serve_inference` in `_inference` (where one request's way through the daemon
reads top to bottom).

Errors are raised, never answered here: the app's one exception handler turns every `QiipError` into its
OpenAI error answer (`_errors`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from qiip_core import TokenScopeError
from qiip_core.auth import InvokeToken
from qiip_core.discovery import RegistryHealth
from qiip_core.nodes import NodeStatus
from qiip_proxy._inference import serve_inference
from qiip_proxy._parse import check_invoke_token
from qiip_proxy.routes._common import gateway_of, serving_of

if TYPE_CHECKING:
    from qiip_proxy._types import ServingGateway

__all__ = ["router"]

router = APIRouter()

_REQUEST_SCHEMA: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["model"],
                    "properties": {
                        "model": {"type": "string", "description": "The model alias a node serves."},
                        "stream": {"type": "boolean", "description": "Answer with server-sent events."},
                    },
                    "additionalProperties": True,
                }
            }
        },
    }
}


class _Inference(Response):
    """Serves an inference request through the same code as `ProxyRoutes` (see `_inference`)."""

    def __init__(self, gateway: ServingGateway) -> None:
        self.gateway = gateway
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_inference(self.gateway, scope, receive, send)


@router.post("/v1/chat/completions", tags=["client"], openapi_extra=_REQUEST_SCHEMA)
async def chat_completions(request: Request) -> Response:
    """Create a chat completion (OpenAI `POST /v1/chat/completions`), streamed with `"stream": true`."""
    return _Inference(serving_of(request))


@router.post("/v1/completions", tags=["client"], openapi_extra=_REQUEST_SCHEMA)
async def completions(request: Request) -> Response:
    """Create a text completion (OpenAI `POST /v1/completions`)."""
    return _Inference(serving_of(request))


@router.post("/v1/embeddings", tags=["client"], openapi_extra=_REQUEST_SCHEMA)
async def embeddings(request: Request) -> Response:
    """Create embeddings (OpenAI `POST /v1/embeddings`)."""
    return _Inference(serving_of(request))


def _model_object(model: str, owned_by: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": owned_by}


def _token(request: Request) -> InvokeToken | None:
    """The request's invoke token when tokens are required, else None.

    Raises:
        AuthError: the token is missing, unknown, expired or revoked.
    """
    gateway = serving_of(request)
    secret = check_invoke_token(gateway, request.scope)
    return gateway.tokens.authenticate(secret, model=None) if secret is not None else None


@router.get("/v1/models", tags=["client"])
async def list_models(request: Request) -> Response:
    """The models served by at least one healthy node (OpenAI `GET /v1/models`); with a token bound to one
    model, only that one."""
    token = _token(request)
    only = token.model if token is not None else None
    served = serving_of(request).table.models()
    data = [_model_object(model, engine.value) for model, engine in sorted(served.items()) if only in (None, model)]
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{model:path}", tags=["client"])
async def retrieve_model(request: Request, model: str) -> Response:
    """One model (OpenAI `GET /v1/models/{model}`): 404 when no node serves it, 503 when none is healthy."""
    token = _token(request)
    if token is not None and not token.allows(model):
        raise TokenScopeError(f"This invoke token may not use the model {model!r}.", token_id=token.id, model=model)
    table = serving_of(request).table
    served = table.models()
    if model not in served:
        raise table.routing_error(model)
    return JSONResponse(_model_object(model, served[model].value))


@router.get("/health", tags=["client"])
async def health(request: Request) -> JSONResponse:
    """Gateway health: `status` (`ok`; `starting` while the daemon's own llama.cpp nodes are still starting, their
    models answering 503 meanwhile; `degraded` when the registry is failing and the gateway serves the fleet it last
    knew; `unavailable`, with status 503, when the registry is failing and no node is routable), `nodes_registered`,
    `nodes_healthy`, the registry's state (with `last_known_at` when it serves a saved fleet), and the launch state
    of the daemon's own llama.cpp nodes."""
    gateway = gateway_of(request)
    counts = gateway.table.count_by_status()
    healthy = counts.get(NodeStatus.HEALTHY, 0)
    registry = gateway.registry.status()
    code = 200
    if registry.health is RegistryHealth.DEGRADED:
        # A load balancer should send clients elsewhere: this gateway knows no fleet, or none of it answers.
        status, code = ("degraded", 200) if healthy else ("unavailable", 503)
    elif gateway.local_nodes.starting:
        status = "starting"
    else:
        status = "ok"
    return JSONResponse(
        {
            "status": status,
            "nodes_registered": len(gateway.table),
            "nodes_healthy": healthy,
            "registry": {
                "backend": registry.backend,
                "state": registry.health.value,
                "detail": registry.detail,
                "last_known_at": registry.last_known_at.isoformat() if registry.last_known_at else None,
            },
            "local_nodes": gateway.local_nodes.states(),
        },
        status_code=code,
    )
