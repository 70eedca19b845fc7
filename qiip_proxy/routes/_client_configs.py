"""`GET /chat/config/{client}?model=M`: a coding agent's config for a model through this gateway, as a download.

The browser page offers these next to the chat; anyone who may call the inference API may fetch one, so the
route sits behind the same invoke-token check (with the same throttle and failure counter) as
`/v1/chat/completions`. The config points at the URL the request came in on, plus `/v1`, so a user behind a
proxy or a published name gets a URL that works from where they are. The key is `QIIP_TOKEN` read from the
environment when the daemon requires tokens, else a placeholder: the file never holds a secret.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from qiip_core.clientconfig import ApiKey, ClientKind, render_target, resolve_target
from qiip_proxy._errors import RequestRefused
from qiip_proxy._parse import check_invoke_token
from qiip_proxy.routes._common import gateway_of

if TYPE_CHECKING:
    from qiip_proxy._gateway import Gateway

__all__ = ["router"]

router = APIRouter()

_CLIENTS = ", ".join(kind.value for kind in ClientKind)


def _authenticate(gateway: Gateway, request: Request, model: str) -> None:
    """The client API's token check (`check_invoke_token`), then the token's model scope.

    Raises:
        RequestRefused: 429, the peer failed too often.
        AuthError: the token is missing, unknown, expired, revoked, or bound to another model.
    """
    secret = check_invoke_token(gateway, request.scope)
    if secret is not None:
        gateway.tokens.authenticate(secret, model=model)


@router.get("/chat/config/{client}", tags=["client"])
async def client_config(
    request: Request, client: str, model: Annotated[str, Query(min_length=1, max_length=512)]
) -> Response:
    """A coding agent's config for `model` through this gateway, as an attachment: `opencode` (opencode.json),
    `pi` (models.json), `omp` (models.yaml) or `continue` (config.yaml). Its base URL is the one this request
    came in on plus `/v1`; its context window and longest answer the smallest over the model's healthy nodes'
    verified runtimes (left out when one is unknown). 404 `client_not_found` for another client, 404
    `model_not_found` when no node serves the model; 401 without an invoke token when the daemon requires one."""
    gateway = gateway_of(request)
    _authenticate(gateway, request, model)
    try:
        kind = ClientKind(client)
    except ValueError:
        raise RequestRefused(
            404, f"There is no config for the client {client[:64]!r}; the clients: {_CLIENTS}.", "client_not_found"
        ) from None
    nodes = [state.effective_node() for state in gateway.table]
    root = str(request.base_url).rstrip("/")
    try:
        target = resolve_target(nodes, model=model, gateway_url=root)
    except ValueError:
        # Only a Host header that makes no URL gets here: the nodes' endpoints are checked when registered.
        raise RequestRefused(400, "The request's Host header does not make an http(s) URL.", "invalid_host") from None
    rendered = render_target(target, kind, ApiKey.for_gateway(tokens_required=gateway.tokens_required))
    return Response(
        rendered.text,
        media_type=rendered.media_type,
        headers={"Content-Disposition": f'attachment; filename="{rendered.file_name}"', "Cache-Control": "no-store"},
    )
