"""The one error registry: every `QiipError` becomes an answer that is not a 500, the same way on both APIs."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import qiip_core
from qiip_core import (
    ConfigError,
    EndpointNotAllowed,
    EndpointNotSupported,
    FailoverExhausted,
    ModelNotFound,
    NodeConflict,
    NodeNotFound,
    NoNodes,
    PlanError,
    QiipError,
    RegistryUnavailable,
    TokenInvalid,
    TokenNotFound,
    TokenRevoked,
    TokenScopeError,
    UpstreamStatusError,
    UpstreamTimeout,
)
from qiip_core.config import load_settings
from qiip_core.planner import Violation
from qiip_proxy._app import create_app, serving_app
from qiip_proxy._errors import RequestRefused, describe_error, sse_error_event
from qiip_proxy._gateway import Gateway

PACKAGES = ("qiip_core", "qiip_proxy", "qiip_tui", "qiip_cli")

JSON = {"Content-Type": "application/json"}


def _import_every_module() -> None:
    """Import every module of every package, so every `QiipError` subclass is defined."""
    for name in PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            if not info.name.endswith(".__main__"):  # running it is what importing it does
                importlib.import_module(info.name)


def _subclasses(cls: type) -> Iterator[type]:
    sub: type
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


_import_every_module()
ERRORS = sorted(
    {c for c in _subclasses(QiipError) if c.__module__.split(".")[0] in PACKAGES}, key=lambda c: c.__qualname__
)

_ARGUMENTS: dict[str, Any] = {
    "message": "Something failed.",
    "endpoint": "http://x:1",
    "node_id": "n1",
    "model": "m",
    "token_id": "tok_1",
    "status": 502,
    "code": "refused",
    "body": b"",
    "expected": "a",
    "actual": "b",
    "field": "slots",
    "name": "qwen",
    "path": Path("model.gguf"),
    "rolled_back": False,
    "attempts": 2,
    "last": UpstreamTimeout("The node timed out.", node_id="n1"),
    "violations": [],
    "artifact_id": "0" * 64,
    "cache_dir": Path("hub"),
    "host": "gpu01",
    "reason": "max_in_flight",
    "retry_after_s": 1.0,
}


def _instance(cls: type[QiipError]) -> QiipError:
    """An instance of `cls`, its required arguments filled by name."""
    parameters = inspect.signature(cls).parameters.values()
    required = {p.name: _ARGUMENTS[p.name] for p in parameters if p.default is inspect.Parameter.empty}
    return cls(**required)


def test_the_walk_finds_every_family() -> None:
    names = {c.__name__ for c in ERRORS}
    # The core's tree, the client's (qiip_core.client), the console's themes and the daemon's refusals.
    assert set(qiip_core.__all__) - {"QiipError", "__version__"} <= names
    assert {"ApiError", "DaemonUnreachable", "ThemeFileError", "RequestRefused", "AdminError"} <= names


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_error_carries_an_answer_that_is_not_a_500(cls: type[QiipError]) -> None:
    assert isinstance(cls.status, int) and cls.status != 500, cls.status
    assert isinstance(cls.code, str) and cls.code and cls.code != "internal_error", cls.code
    status, body, _ = describe_error(_instance(cls))
    error = json.loads(body)["error"]
    assert status != 500 and 400 <= status < 600
    assert isinstance(error["code"], str) and error["code"] and error["type"] and error["message"]


ANSWERS: list[tuple[QiipError, int, str, str, str | None, dict[str, str]]] = [
    (ModelNotFound("No such model.", model="m"), 404, "invalid_request_error", "model_not_found", "model", {}),
    (NoNodes("No nodes.", model="m"), 503, "service_unavailable_error", "no_nodes", None, {}),
    (EndpointNotSupported("No API.", model="m"), 400, "invalid_request_error", "endpoint_not_supported", "model", {}),
    (UpstreamTimeout("Slow.", node_id="n"), 504, "upstream_error", "backend_timeout", None, {"X-QIIP-Attempts": "1"}),
    (
        FailoverExhausted(
            attempts=3, last=UpstreamStatusError("HTTP 503", node_id="n", status=503, body=b""), failures=None
        ),
        503,
        "upstream_error",
        "failover_exhausted",
        None,
        {"X-QIIP-Failover": "exhausted", "X-QIIP-Attempts": "3"},
    ),
    (
        TokenInvalid("Unknown token."),
        401,
        "authentication_error",
        "invalid_api_key",
        None,
        {"WWW-Authenticate": 'Bearer realm="qiip"'},
    ),
    (TokenScopeError("Other model.", token_id="t", model="m"), 403, "permission_error", "model_not_allowed", None, {}),
    (TokenNotFound("tok_1"), 404, "invalid_request_error", "token_not_found", None, {}),
    (NodeNotFound("n1"), 404, "invalid_request_error", "node_not_found", "node_id", {}),
    (NodeConflict("Busy."), 409, "invalid_request_error", "conflict", None, {}),
    (
        EndpointNotAllowed("Outside.", endpoint="x"),
        400,
        "invalid_request_error",
        "endpoint_not_allowed",
        "endpoint",
        {},
    ),
    (ConfigError("Token file."), 409, "invalid_request_error", "profile_invalid", None, {}),
    (RegistryUnavailable("Down."), 503, "service_unavailable_error", "registry_unavailable", None, {}),
    (
        RequestRefused(401, "Credentials.", "unauthorized", type="authentication_error", headers={"A": "b"}),
        401,
        "authentication_error",
        "unauthorized",
        None,
        {"A": "b"},
    ),
    (
        RequestRefused(413, "Too large.", "request_too_large"),
        413,
        "invalid_request_error",
        "request_too_large",
        None,
        {},
    ),
]


@pytest.mark.parametrize(
    ("exc", "status", "kind", "code", "param", "headers"),
    ANSWERS,
    ids=[f"{type(a[0]).__name__}-{a[3]}" for a in ANSWERS],
)
def test_the_answer_of_each_family(
    exc: QiipError, status: int, kind: str, code: str, param: str | None, headers: dict[str, str]
) -> None:
    answer = describe_error(exc)
    assert answer.status == status and answer.headers == headers
    assert json.loads(answer.body) == {"error": {"message": exc.message, "type": kind, "param": param, "code": code}}


def test_a_policy_error_lists_its_violations() -> None:
    exc = PlanError("Invalid.", violations=[Violation(field="slots", message="Too many.")])
    answer = describe_error(exc)
    assert answer.status == 422
    assert json.loads(answer.body)["error"] == {
        "message": "Invalid.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_policy",
        "violations": [{"field": "slots", "message": "Too many."}],
    }


def test_an_in_band_error_is_one_sse_event() -> None:
    event = sse_error_event(TokenRevoked("Revoked.", token_id="t"))
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n") and event.count(b"\n\n") == 1
    assert json.loads(event[6:])["error"]["code"] == "token_revoked"


async def test_both_apis_answer_through_the_one_handler(tmp_path: Path) -> None:
    settings = load_settings(state_dir=tmp_path, admin={"username": "admin", "password": "pw"})
    transport = httpx.ASGITransport(app=serving_app(create_app(Gateway(settings))))
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost", headers=JSON) as client:
        # The client API, through FastAPI's routes and through the plain ASGI inference path.
        missing = await client.get("/v1/models/m")
        assert missing.status_code == 503 and missing.json()["error"]["code"] == "no_nodes"
        bad = await client.post("/v1/chat/completions", content=b"{")
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
        assert bad.headers["x-request-id"]
        # The admin API: a core error and one of its own.
        node = await client.get("/admin/nodes/n1", auth=("admin", "pw"))
        assert node.status_code == 404
        assert node.json() == {
            "error": {
                "message": "No node is registered with id 'n1'.",
                "type": "invalid_request_error",
                "param": "node_id",
                "code": "node_not_found",
            }
        }
        refused = await client.get("/admin/nodes", auth=("admin", "wrong"))
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
        assert refused.json()["error"]["type"] == "authentication_error"
        # A lost registration is torn down only for an engine QIIP provisions: `attached` is refused, by name.
        attached = await client.delete(
            "/admin/nodes/n1", params={"force": "true", "recovery_engine": "attached"}, auth=("admin", "pw")
        )
        assert attached.status_code == 422, attached.text
        assert attached.json()["error"]["param"] == "recovery_engine"
        assert "'llama_cpp', 'vllm' or 'ollama'" in attached.json()["error"]["message"]


async def test_a_large_body_has_its_members_counted_before_it_is_parsed(tmp_path: Path) -> None:
    settings = load_settings(state_dir=tmp_path, admin={"username": "admin", "password": "pw"})
    transport = httpx.ASGITransport(app=serving_app(create_app(Gateway(settings))))
    many_keys = b'{"model": "m", "x": {' + b",".join(b'"k%d": 0' % i for i in range(250_000)) + b"}}"
    deep = b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost", headers=JSON) as client:
        too_many = await client.post("/v1/chat/completions", content=many_keys)
        assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "json_too_complex"
        assert "more than 50000 object members" in too_many.json()["error"]["message"]
        too_deep = await client.post("/v1/chat/completions", content=deep)
        assert too_deep.status_code == 400 and too_deep.json()["error"]["code"] == "invalid_json"
        # A large body within the bounds is read as usual (here: no node serves the model).
        fine = b'{"model": "m", "padding": "' + b"x" * (1 << 20) + b'"}'
        assert (await client.post("/v1/chat/completions", content=fine)).json()["error"]["code"] == "no_nodes"
