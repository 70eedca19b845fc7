"""The admin API: `/admin/*`, behind HTTP Basic credentials.

Every route needs the configured credentials (compared in constant time; 401 with `WWW-Authenticate`
otherwise). State-changing routes accept `application/json` only (415 otherwise): a cross-origin browser
cannot send JSON without a preflight, which is the CSRF boundary. Request bodies are strict (unknown
fields: 422). Work that waits (drains, removals, relaunches) runs as a background operation: the answer is
202 with the operation, to follow at `/admin/operations/{id}`.

Routes raise their errors and never answer them: the app's one exception handler turns every `QiipError`
(the core's, and `AdminError` for what only this API refuses) into its error answer (`_errors`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.security import HTTPBasic, HTTPBasicCredentials
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse, Response, StreamingResponse

from qiip_core import ArtifactIdInvalid, NodeNotFound, PlanError, RelaunchError
from qiip_core._violation import first_violation
from qiip_core.catalog import artifact_entrypoint, resolve_artifact_id
from qiip_core.lifecycle import (
    Operation,
    check_can_drain,
    check_can_relaunch,
    check_can_remove,
    check_can_undrain,
    drain,
    relaunch,
    remove,
)
from qiip_core.nodes import Engine, Node, NodeCapabilities, NodeStatus, ProvisionedEngine
from qiip_core.planner import parse_policy
from qiip_core.routing import ChangeKind, NodeState, TableChange
from qiip_proxy._errors import RequestRefused
from qiip_proxy.layers._auth_gate import admin_credentials_ok, admin_unauthorized, basic_credentials
from qiip_proxy.routes._common import gateway_of

if TYPE_CHECKING:
    from qiip_core.telemetry import TelemetryStore
    from qiip_proxy._gateway import Gateway

__all__ = ["AdminError", "node_view", "require_admin", "router"]


class _Basic(HTTPBasic):
    """FastAPI's HTTP Basic security scheme (for the OpenAPI document), with the credentials decoded as the admin
    gate decodes them (`basic_credentials`: UTF-8, RFC 7617), so a password outside ASCII works in both."""

    async def __call__(self, request: HTTPConnection) -> HTTPBasicCredentials | None:  # type: ignore[override]
        given = basic_credentials(request.headers.get("authorization", "").encode("latin-1") or None)
        if given is None:
            return None
        user, password = given
        return HTTPBasicCredentials(username=user.decode("utf-8"), password=password.decode("utf-8"))


_basic = _Basic(auto_error=False, realm="qiip-admin")


class AdminError(RequestRefused):
    """An admin API refusal of its own: 400, 401, 404, 409, 415, 422 with an OpenAI-shaped error body."""


async def require_admin(request: Request, credentials: Annotated[HTTPBasicCredentials | None, Depends(_basic)]) -> None:
    """Check the HTTP Basic credentials; state-changing methods must also send JSON."""
    settings = gateway_of(request).settings.admin
    expected_user = (settings.username or "").encode("utf-8")
    expected_password = settings.password.get_secret_value().encode("utf-8") if settings.password else b""
    given = (credentials.username.encode("utf-8"), credentials.password.encode("utf-8")) if credentials else None
    if not admin_credentials_ok(given, (expected_user, expected_password)):
        raise admin_unauthorized(presented=credentials is not None)
    if request.method in ("POST", "PUT", "PATCH"):
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            raise AdminError(415, "State-changing admin requests must send application/json.", "unsupported_media_type")


router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])
"""The admin routes; the provisioning ones are `qiip_proxy.routes._provisioning`'s."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterNode(_Strict):
    """`POST /admin/nodes`: register an external node (the endpoint allowlist applies)."""

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    endpoint: str = Field(min_length=1, max_length=512)
    model: str = Field(min_length=1, max_length=512)
    engine: Engine = Engine.VLLM
    capabilities: NodeCapabilities = Field(default_factory=NodeCapabilities)


class DrainRequest(_Strict):
    """`POST /admin/nodes/{id}/drain`."""

    timeout_s: float | None = Field(default=None, gt=0, le=86_400)
    """How long to wait for in-flight requests (default `admin.drain_timeout_s`)."""


class Empty(_Strict):
    """A body with no fields (`{}`)."""


class CreateToken(_Strict):
    """`POST /admin/tokens`: an invoke token for one model alias (or all, with `model` null)."""

    model: str | None = Field(default=None, min_length=1, max_length=512)
    """The model alias the token may use; null for every model."""
    ttl_s: float | None = Field(default=None, ge=1)
    """Seconds until it expires (default `auth.token_default_ttl_s`, at most `auth.token_max_ttl_s`)."""
    description: str = Field(default="", max_length=200)
    """Who or what the token is for."""


def node_view(
    state: NodeState, quads: dict[str, Any] | None = None, telemetry: TelemetryStore | None = None
) -> dict[str, Any]:
    """A node as the admin API shows it: the registration, effective status and what this gateway sees.

    Args:
        state: the node's routing state.
        quads: what the QUADS scheduler says of its host (None without QUADS or for a host it does not lend).
        telemetry: the live GPU readings; with it, `gpus_live` holds the node's (`TelemetryStore.view`, null
            without a reading).
    """
    node = state.effective_node()
    view = node.model_dump(mode="json")
    view.update(
        {
            "source": state.source,
            "in_flight": state.in_flight,
            "breaker": {"state": state.breaker.state.value, "consecutive_failures": state.breaker.consecutive_failures},
            "last_error": state.last_error,
            "last_error_at": state.last_error_at.isoformat() if state.last_error_at else None,
            "recent_errors": state.error_views(),
            "slots": {"busy": state.slots[0], "total": state.slots[1]} if state.slots is not None else None,
            "resident": None if state.resident is None else [m.model_dump(mode="json") for m in state.resident],
            "health": {
                "consecutive_failures": state.health_failures,
                "last_probe_at": state.last_probe_at.isoformat() if state.last_probe_at else None,
                "observed": state.observed,
            },
            "quads": quads,
            "gpus_live": telemetry.view(state.id) if telemetry is not None else None,
        }
    )
    return view


def _node_or_404(gateway: Gateway, node_id: str) -> NodeState:
    state = gateway.table.get(node_id)
    if state is None:
        raise NodeNotFound(node_id)
    return state


@router.get("/nodes")
async def list_nodes(request: Request) -> JSONResponse:
    """Every node with its status, engine, model, artifact, llama.cpp runtime, in-flight requests, circuit
    breaker, last error, last health observation, live GPUs (`gpus_live`, from `qiip agent`), and what QUADS says
    of its host (`quads`). With QUADS configured, the GPU hosts it lends that are not nodes follow, with the status
    `not_provisioned`, and `quads` says how fresh QIIP's read of QUADS is (null without QUADS)."""
    gateway = gateway_of(request)
    nodes = [
        node_view(s, gateway.quads_view(s.id), gateway.telemetry) for s in sorted(gateway.table, key=lambda s: s.id)
    ]
    quads = None
    if gateway.quads is not None:
        nodes += gateway.quads.unprovisioned(s.id for s in gateway.table)
        quads = gateway.quads.poller.view()
    return JSONResponse({"nodes": nodes, "quads": quads})


@router.get("/nodes/{node_id}")
async def get_node(request: Request, node_id: str) -> JSONResponse:
    """One node (404 when unknown)."""
    gateway = gateway_of(request)
    return JSONResponse(node_view(_node_or_404(gateway, node_id), gateway.quads_view(node_id), gateway.telemetry))


@router.post("/nodes", status_code=201)
async def register_node(request: Request, body: RegisterNode) -> JSONResponse:
    """Register an external node in the registry (400 outside the endpoint allowlist, 409 for a config node)."""
    gateway = gateway_of(request)
    try:
        node = Node(
            id=body.id, endpoint=body.endpoint, model=body.model, engine=body.engine, capabilities=body.capabilities
        )
    except ValidationError as exc:
        error = first_violation(exc)
        raise AdminError(422, f"{error.field}: {error.message}.", "invalid_node", error.field) from None
    stored = await gateway.registry.register(node)
    return JSONResponse(stored.model_dump(mode="json"), status_code=201)


@router.post("/nodes/{node_id}/drain", status_code=202)
async def drain_node(request: Request, node_id: str, body: DrainRequest) -> JSONResponse:
    """Send the node nothing new and wait for its in-flight requests (202: follow the operation)."""
    gateway = gateway_of(request)
    _node_or_404(gateway, node_id)
    timeout_s = body.timeout_s or gateway.settings.admin.drain_timeout_s
    check_can_drain(gateway.table, node_id)
    operation = gateway.operations.start(
        "drain",
        node_id,
        lambda op: drain(gateway.table, gateway.fleet, node_id, timeout_s=timeout_s, log=op.log),
    )
    return JSONResponse(operation.view(), status_code=202)


@router.post("/nodes/{node_id}/undrain")
async def undrain_node(request: Request, node_id: str, body: Empty) -> JSONResponse:
    """Take a drained node back into rotation (409 when it is not draining)."""
    gateway = gateway_of(request)
    state = _node_or_404(gateway, node_id)
    check_can_undrain(gateway.table, node_id)
    gateway.journal.record(node_id, "note", "undrain asked", "an operator took the node back into rotation")
    await gateway.fleet.set_lifecycle(node_id, None)
    return JSONResponse(node_view(state, gateway.quads_view(node_id), gateway.telemetry))


@router.delete("/nodes/{node_id}", status_code=202)
async def delete_node(
    request: Request,
    node_id: str,
    force: Annotated[bool, Query(description="Remove at once, without draining.")] = False,
    recovery_engine: Annotated[
        ProvisionedEngine | None,
        Query(description="With force: the engine to stop on a host whose registration was lost (a provisioned one)."),
    ] = None,
) -> JSONResponse:
    """Drain the node, then remove it (`?force=true`: at once). A node this daemon launched is stopped too; a node
    set up over SSH is torn down (drain, stop its engine, deregister).
    `?force=true&recovery_engine=vllm|llama_cpp|ollama` tears down a host whose registration was lost."""
    gateway = gateway_of(request)
    state = gateway.table.get(node_id)
    provisioned = await gateway.provisioner.is_provisioned(node_id)
    if state is None and not (force and recovery_engine is not None):
        raise NodeNotFound(node_id)
    if state is None or (provisioned and state.source != "config"):
        if state is not None:
            check_can_remove(gateway.table, node_id)
        # A host QUADS lends is re-imaged before its next loan: its host key goes with the node.
        lent = gateway.quads is not None and gateway.quads.lends(node_id)
        operation = await gateway.provisioner.start_teardown(
            node_id, force=force, recovery_engine=recovery_engine, forget_host_key=lent
        )
        return JSONResponse(operation.view(), status_code=202)
    if state.source == "config":
        raise AdminError(409, f"Node {node_id!r} is declared in the config file; remove it there.", "conflict")
    server = gateway.local_nodes.servers.get(node_id)
    timeout_s = gateway.settings.admin.drain_timeout_s
    check_can_remove(gateway.table, node_id)
    operation = gateway.operations.start(
        "remove",
        node_id,
        lambda op: remove(
            gateway.table, gateway.fleet, node_id, force=force, timeout_s=timeout_s, log=op.log, server=server
        ),
    )
    return JSONResponse(operation.view(), status_code=202)


@router.post("/nodes/{node_id}/llamacpp/relaunch", status_code=202)
async def relaunch_node(request: Request, node_id: str) -> JSONResponse:
    """Relaunch a managed llama.cpp node with a sizing policy: `{"sizing": "auto", "fit_target_mib": 512}` or
    `{"sizing": "custom", "fit_target_mib", "context_per_slot", "slots", "cache_type"}` (strict; 422 with
    every violation). 409 unless the node is healthy, managed, llama.cpp, with a runtime record.

    `"artifact_id"` (the id, or its first 8 or more characters) moves the node to another GGUF generation (an
    acquired revision, else the Hugging Face cache), with the given sizing or, without one, the node's current one.

    Everything is checked before the node is touched, and a refusal leaves it serving: a malformed or ambiguous id
    is 422, an unknown or unacquired one 404; a model file that cannot be served here (its own, read again, or the
    new one) is 422 `invalid_model_file` with the reason; a sizing that is invalid, or that does not fit the memory
    the node will have once its server stops, is 422 `invalid_policy` with the plan's numbers. A relaunch that fails
    after that rolls back, and the node is probed at once, so it is routable as soon as the operation ends."""
    gateway = gateway_of(request)
    state = _node_or_404(gateway, node_id)
    try:
        payload = json.loads(await request.body())
    except ValueError as exc:
        raise AdminError(400, f"The body is not valid JSON: {exc}.", "invalid_json") from None
    given = payload.pop("artifact_id", None) if isinstance(payload, dict) else None
    server = gateway.local_nodes.servers.get(node_id)
    policy = server.policy if given is not None and payload == {} and server is not None else None
    policy = policy or parse_policy(payload)
    check_can_relaunch(gateway.table, node_id, server)
    assert server is not None
    artifact: tuple[str, Path] | None = None
    if given is not None:
        if not isinstance(given, str):
            raise ArtifactIdInvalid(repr(given))
        whole = await asyncio.to_thread(resolve_artifact_id, gateway.settings, given)
        artifact = (whole, await asyncio.to_thread(artifact_entrypoint, gateway.settings, whole))
    try:
        await asyncio.to_thread(server.preflight, policy, model_path=artifact[1] if artifact else None)
    except PlanError as exc:
        target = f"artifact {artifact[0]}" if artifact else f"node {node_id}"
        raise PlanError(
            f"The relaunch is refused for {target}; node {node_id} was not touched: {exc.message}",
            violations=exc.violations,
        ) from exc
    node = state.effective_node()

    async def relaunch_and_record(op: Operation) -> dict[str, Any]:
        try:
            result = await relaunch(
                gateway.table,
                gateway.fleet,
                server,
                node.model_copy(update={"status": NodeStatus.UNKNOWN}),
                policy,
                drain_timeout_s=gateway.settings.admin.drain_timeout_s,
                startup_timeout_s=gateway.local_nodes.startup_timeout_s(node_id),
                log=op.log,
                artifact=artifact,
            )
        except RelaunchError as exc:
            if exc.rolled_back:
                # The previous sizing runs again: make it routable before the operation says it ended.
                await gateway.health.probe(node_id)
            raise
        # The node comes back as `unknown`: one probe now makes it routable when the operation says it
        # succeeded, not at the next health interval (requests in between would get 503).
        await gateway.health.probe(node_id)
        if artifact is None:
            # The next start of the daemon launches this sizing again (docs/operator-guide.md); a move to
            # another generation is not kept, as the configuration names the model.
            await asyncio.to_thread(gateway.local_nodes.remember_relaunch, node_id, policy)
        return result

    operation = gateway.operations.start("relaunch", node_id, relaunch_and_record)
    return JSONResponse(operation.view(), status_code=202)


@router.get("/attached")
async def list_attached(request: Request) -> JSONResponse:
    """The approved attached profiles (never their tokens), and whether each is attached now."""
    gateway = gateway_of(request)
    profiles = [
        {
            "name": p.name,
            "url": p.url,
            "model": p.model,
            "capabilities": p.capabilities.model_dump(mode="json"),
            "concurrency": p.concurrency,
            "deadline_s": p.deadline_s,
            "has_token": p.token_file is not None,
            "attached": p.name in gateway.table,
        }
        for p in gateway.profiles.values()
    ]
    return JSONResponse({"attached": profiles})


@router.post("/attached/{name}", status_code=201)
async def attach(request: Request, name: str, body: Empty) -> JSONResponse:
    """Attach an approved profile as a node (404 for a name not in `[[attached]]`, 409 when attached)."""
    gateway = gateway_of(request)
    if name not in gateway.profiles:
        raise AdminError(404, f"No attached profile is named {name!r}.", "profile_not_found", "name")
    if name in gateway.table:
        raise AdminError(409, f"The profile {name!r} is attached already.", "conflict")
    node = gateway.attach(name)
    return JSONResponse(node.model_dump(mode="json"), status_code=201)


@router.post("/tokens", status_code=201)
async def create_token(request: Request, body: CreateToken) -> JSONResponse:
    """Create an invoke token. The answer carries its secret, shown this once and stored only as a hash."""
    gateway = gateway_of(request)
    token, secret = await gateway.tokens.create(model=body.model, ttl_s=body.ttl_s, description=body.description)
    if gateway.workers is not None:
        gateway.workers.tokens_changed()
    return JSONResponse({**token.public(), "secret": secret}, status_code=201)


@router.get("/tokens")
async def list_tokens(request: Request) -> JSONResponse:
    """Live invoke tokens (not expired, not revoked), without their secrets."""
    tokens = await gateway_of(request).tokens.list()
    return JSONResponse({"tokens": [t.public() for t in tokens]})


@router.delete("/tokens/{token_id}")
async def revoke_token(request: Request, token_id: str) -> JSONResponse:
    """Revoke an invoke token; requests running on it end at once (streams with an in-band error)."""
    gateway = gateway_of(request)
    token = await gateway.tokens.revoke(token_id)
    if gateway.workers is not None:
        gateway.workers.tokens_changed()
    return JSONResponse(token.public())


@router.get("/operations")
async def list_operations(request: Request) -> JSONResponse:
    """Recent background operations, newest first."""
    return JSONResponse({"operations": [op.view() for op in gateway_of(request).operations.list()]})


@router.get("/operations/{operation_id}")
async def get_operation(request: Request, operation_id: str) -> JSONResponse:
    """One operation: state, result, error and its log."""
    operation = gateway_of(request).operations.get(operation_id)
    if operation is None:
        raise AdminError(404, f"No operation has id {operation_id!r}.", "operation_not_found", "operation_id")
    return JSONResponse(operation.view())


@router.get("/metrics")
async def admin_metrics(request: Request) -> JSONResponse:
    """Request counters by model and by node, as JSON."""
    return JSONResponse(gateway_of(request).metrics.snapshot())


@router.get("/events", response_class=StreamingResponse)
async def events(
    request: Request,
    heartbeat_s: Annotated[float, Query(gt=0, le=300, description="Seconds between heartbeat comments.")] = 15.0,
) -> Response:
    """Server-sent events of node changes: `event: node` with `{"change": "added"|"updated"|"removed", "node":
    {...}}`, starting with every current node as `added`, and a `: heartbeat` comment when idle. The stream
    ends when the daemon begins to shut down (a client reconnects to the next one)."""
    gateway = gateway_of(request)
    queue: asyncio.Queue[TableChange | None] = asyncio.Queue(maxsize=1024)

    def listener(change: TableChange | None) -> None:
        if queue.full():
            # A console that stopped reading gets a gap rather than unbounded memory; it resyncs on reconnect.
            queue.get_nowait()
        queue.put_nowait(change)

    def end() -> None:
        listener(None)  # the stream's end

    unsubscribe = gateway.table.add_listener(listener)
    gateway.on_shutdown_begun.add(end)
    if gateway.shutting_down:
        end()

    async def stream() -> AsyncIterator[bytes]:
        try:
            for state in sorted(gateway.table, key=lambda s: s.id):
                yield _event(
                    {"change": "added", "node": node_view(state, gateway.quads_view(state.id), gateway.telemetry)}
                )
            while True:
                try:
                    change = await asyncio.wait_for(queue.get(), heartbeat_s)
                except TimeoutError:
                    yield b": heartbeat\n\n"
                    continue
                if change is None:
                    return
                current = gateway.table.get(change.node.id)
                view = (
                    node_view(current, gateway.quads_view(current.id), gateway.telemetry)
                    if current is not None and change.kind is not ChangeKind.REMOVED
                    else change.node.model_dump(mode="json")
                )
                yield _event({"change": change.kind.value, "node": view})
        finally:
            unsubscribe()
            gateway.on_shutdown_begun.discard(end)

    return StreamingResponse(
        stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def _event(data: dict[str, Any]) -> bytes:
    return b"event: node\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
