"""The layers `serving_app` puts around the daemon's routes, in process: what runs for every request."""

from __future__ import annotations

from pathlib import Path

import httpx
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from qiip_core.config import load_settings
from qiip_proxy._app import create_app, direct_route, serving_app
from qiip_proxy._gateway import Gateway
from qiip_proxy._inference import DirectInference, ProxyRoutes
from qiip_proxy.layers._http import AllowedHosts

ORIGIN = "https://app.example.com"


def served(tmp_path: Path, **server: object) -> ASGIApp:
    settings = load_settings(state_dir=tmp_path, admin={"enabled": False}, server=server)
    return serving_app(create_app(Gateway(settings)))


def test_with_cors_off_the_fast_path_is_behind_the_host_check_only(tmp_path: Path) -> None:
    # Nothing of CORS runs per request: the inference path pays nothing for it, and one set lookup for its Host.
    app = served(tmp_path)
    assert isinstance(app, AllowedHosts) and type(app.app) is ProxyRoutes
    # With the check off, nothing at all.
    assert type(served(tmp_path, allowed_hosts=["*"])) is ProxyRoutes


def test_with_cors_on_it_wraps_the_fast_path_too(tmp_path: Path) -> None:
    app = served(tmp_path, cors_allow_origins=[ORIGIN])
    assert isinstance(app, AllowedHosts) and isinstance(app.app, CORSMiddleware) and type(app.app.app) is ProxyRoutes


def test_the_server_answers_the_inference_paths_itself_only_where_the_host_check_is_the_only_layer(
    tmp_path: Path,
) -> None:
    def route(**server: object) -> DirectInference | None:
        settings = load_settings(state_dir=tmp_path, admin={"enabled": False}, server=server)
        return direct_route(Gateway(settings))

    default = route()
    assert default is not None and default.hosts is not None
    assert default.paths == {b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings"}
    unchecked = route(allowed_hosts=["*"])
    assert unchecked is not None and unchecked.hosts is None
    # CORS and forwarded headers are layers of their own: their requests go the ASGI way.
    assert route(cors_allow_origins=[ORIGIN]) is None
    assert route(forwarded_allow_ips=["10.0.0.1"]) is None


async def test_head_and_cors_in_process(tmp_path: Path) -> None:
    app = served(tmp_path, cors_allow_origins=[ORIGIN])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://localhost", headers={"Origin": ORIGIN}
    ) as client:
        get = await client.get("/v1/models")
        head = await client.head("/v1/models")
        assert (head.status_code, head.content) == (200, b"")
        assert head.headers["content-length"] == get.headers["content-length"] != "0"
        assert head.headers["access-control-allow-origin"] == ORIGIN
        # An answer of the plain ASGI inference path, ahead of FastAPI's middleware.
        refused = await client.post("/v1/chat/completions", content=b"{", headers={"Content-Type": "application/json"})
        assert refused.status_code == 400 and refused.headers["access-control-allow-origin"] == ORIGIN
