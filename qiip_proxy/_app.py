"""The daemon's ASGI application."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp

import qiip_core
from qiip_core import QiipError
from qiip_core._violation import first_violation
from qiip_proxy._errors import RequestRefused, error_response
from qiip_proxy._gateway import Gateway
from qiip_proxy._inference import DirectInference, ProxyRoutes
from qiip_proxy._types import ServingGateway
from qiip_proxy.layers._auth_gate import AdminGate
from qiip_proxy.layers._http import HeadAsGet, HostCheck, with_allowed_hosts, with_cors
from qiip_proxy.routes._admin import router as admin_router
from qiip_proxy.routes._chat_page import add_chat_page
from qiip_proxy.routes._client_api import router as client_router
from qiip_proxy.routes._client_configs import router as client_configs_router
from qiip_proxy.routes._deployments import router as deployments_router
from qiip_proxy.routes._journal import router as journal_router
from qiip_proxy.routes._models import router as models_router
from qiip_proxy.routes._provisioning import router as provisioning_router
from qiip_proxy.routes._state import router as state_router

__all__ = ["add_error_handlers", "create_app", "direct_route", "serving_app", "wrap_serving"]


def create_app(gateway: Gateway) -> FastAPI:
    """Build the daemon's app over `gateway`, built for its settings (in a test: `create_app(Gateway(settings))`).

    The gateway starts in the app's lifespan (registry, health checks, local nodes, worker processes) and stops
    with it.
    """
    settings = gateway.settings

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.startup()
        try:
            yield
        finally:
            await gateway.shutdown()

    app = FastAPI(
        title="QIIP",
        version=qiip_core.__version__,
        description="One OpenAI-compatible endpoint over a fleet of llama.cpp and vLLM nodes.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.gateway = gateway
    app.include_router(client_router)
    if settings.server.chat_page:
        add_chat_page(app)
        app.include_router(client_configs_router)
    if settings.admin.enabled:
        # The setup route first: `/admin/nodes/setup` is not a node id.
        app.include_router(provisioning_router)
        app.include_router(admin_router)
        app.include_router(journal_router)
        app.include_router(models_router)
        app.include_router(deployments_router)
        app.include_router(state_router)

    add_error_handlers(app)

    @app.get("/metrics", tags=["operations"], include_in_schema=True)
    async def metrics() -> Response:
        """Prometheus metrics per model and node: requests, errors, failovers, upstream errors by kind, tokens,
        in-flight, time to first token and latency."""
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def add_error_handlers(app: FastAPI) -> None:
    """The app's error answers: every error as OpenAI's error JSON with its status and code (`_errors`)."""

    # The one exception handler of both APIs: every error carries its status and code (`_errors`).
    @app.exception_handler(QiipError)
    async def qiip_error(request: Request, exc: QiipError) -> Response:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        refused = RequestRefused(exc.status_code, str(exc.detail), code)
        return error_response(refused, headers=dict(exc.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = first_violation(exc, skip=1)  # the location starts with where the value came from ("body")
        return error_response(RequestRefused(422, first.message, "invalid_request", first.field or None))


def serving_app(app: FastAPI) -> ASGIApp:
    """The app as the server runs it: the inference paths served ahead of FastAPI's routing layers, the admin
    API's credentials and body size checked before FastAPI reads a body (`_auth_gate`), `HEAD` answered on
    every `GET` route, with `server.cors_allow_origins` set, CORS around all of it, and outermost the `Host`
    check (`_http`).

    With CORS off there is no CORS layer at all, so the inference path pays nothing for it; with CORS on,
    every request passes through Starlette's `CORSMiddleware` (one header lookup, and one more call per
    message sent: each event of a stream)."""
    gateway: Gateway = app.state.gateway
    return wrap_serving(gateway, HeadAsGet(app))


def wrap_serving(gateway: ServingGateway, inner: ASGIApp, *, admin_gate: bool = True) -> ASGIApp:
    """`inner` behind the layers every serving process puts before its routes (`serving_app`); a worker, which
    passes the admin API on to the primary (whose gate checks it), goes without the admin gate."""
    admin = gateway.settings.admin
    if admin_gate and admin.enabled and admin.username and admin.password is not None:
        inner = AdminGate(
            inner,
            username=admin.username,
            password=admin.password.get_secret_value(),
            max_body_bytes=admin.max_body_bytes,
            max_restore_bytes=admin.max_restore_bytes,
            throttle=gateway.admin_throttle,
            on_failure=lambda api: gateway.metrics.auth_failures.labels(api).inc(),
        )
    served: ASGIApp = ProxyRoutes(inner, gateway)
    server = gateway.settings.server
    if server.cors_allow_origins:
        served = with_cors(served, server.cors_allow_origins)
    return with_allowed_hosts(served, allowed_hosts=server.allowed_hosts, bind_host=server.host)


def direct_route(gateway: ServingGateway) -> DirectInference | None:
    """The inference paths for the HTTP server to answer itself, ahead of the layers `wrap_serving` stacks (the same
    steps, and the same `Host` check); None where a layer other than the `Host` check must see them: CORS
    (`server.cors_allow_origins`) and forwarded headers (`server.forwarded_allow_ips`, uvicorn's own layer), whose
    requests then go the ASGI way.

    Args:
        gateway: the serving process's gateway.
    """
    server = gateway.settings.server
    if server.cors_allow_origins or server.forwarded_allow_ips:
        return None
    hosts = (
        None if "*" in server.allowed_hosts else HostCheck(allowed_hosts=server.allowed_hosts, bind_host=server.host)
    )
    return DirectInference(gateway, hosts)
