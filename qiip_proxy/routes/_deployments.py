"""The admin API of deployments and the host pool.

```
GET    /admin/deployments                                every deployment with its status
POST   /admin/deployments                                create (409 when the name is taken)        → 201
PUT    /admin/deployments/{name}?generation=N            create or replace; with `generation`, only if the stored
                                                         one is at N (0: only if absent)            → 200 / 201
GET    /admin/deployments/{name}                         {name, generation, spec, template, history, status}
DELETE /admin/deployments/{name}                         drain and tear down every replica, then the record → 202
POST   /admin/deployments/{name}/scale                   {"replicas": N, "generation"?: G}
POST   /admin/deployments/{name}/rollout                 {"source"?, "engine"?, "runtime"?, "generation"?}
POST   /admin/deployments/{name}/rollout/undo            {"generation"?}
POST   /admin/deployments/plan                           {"spec", "load": {requests_per_s, prompt_tokens,
                                                         answer_tokens}, "tokens_per_s"?}: the replicas and hosts
                                                         the load needs, applying nothing
GET    /admin/deployments/{name}/explain                 the last placement: every host, chosen or not, and why
GET    /admin/deployments/{name}/events?follow=true      server-sent `event: deployment` per event, kept then live
GET    /admin/hosts                                      the host pool and what is known of each host
POST   /admin/hosts                                      add a host {name, labels?, gpus?, memory_mib?}   → 201
DELETE /admin/hosts/{name}                               remove an added host                       → 204
```

A refused spec answers 422 `invalid_deployment` with `param` naming the first field at fault and every violation
in `violations`; a stale generation 409 `conflict`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse

from qiip_core import DeploymentInvalid, DeploymentNotFound, QiipError
from qiip_core._violation import Violation, first_violation
from qiip_core.deployments import Decode, Load
from qiip_proxy.routes._admin import AdminError, require_admin
from qiip_proxy.routes._common import gateway_of
from qiip_proxy.routes._log_stream import SSE_HEADERS

if TYPE_CHECKING:
    from qiip_core.deployments import DeploymentService

__all__ = ["router"]

router = APIRouter(prefix="/admin", tags=["deployments"], dependencies=[Depends(require_admin)])

_Generation = Annotated[int | None, Query(ge=0, description="Apply only if the stored generation is this (0: absent).")]


class _Scale(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    replicas: int = Field(ge=0, le=1000)
    generation: int | None = Field(default=None, ge=1)


class _Undo(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    generation: int | None = Field(default=None, ge=1)


class _Load(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    requests_per_s: float = Field(gt=0, le=1_000_000)
    prompt_tokens: int = Field(ge=1, le=10_000_000)
    answer_tokens: int = Field(ge=1, le=10_000_000)


class _PlanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    spec: dict[str, Any]
    load: _Load
    tokens_per_s: float | None = Field(default=None, gt=0, le=1_000_000)


def _service(request: Request) -> DeploymentService:
    gateway = gateway_of(request)
    return gateway.deployments


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw) if raw else {}
    except ValueError as exc:
        raise AdminError(400, f"The body is not JSON: {exc}.", "invalid_json") from None


async def _object(request: Request) -> dict[str, Any]:
    data = await _json(request)
    if not isinstance(data, dict):
        raise AdminError(400, "The body must be a JSON object.", "invalid_json")
    return data


def _model(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = first_violation(exc)
        field = error.field or "body"
        raise DeploymentInvalid(f"{field}: {error.message}.", violations=[Violation(field, error.message)]) from None


@router.get("/deployments")
async def list_deployments(request: Request) -> JSONResponse:
    """Every deployment with its status: `{deployments: [...]}`, by name."""
    return JSONResponse({"deployments": await _service(request).views()})


@router.post("/deployments", status_code=201)
async def create_deployment(request: Request) -> JSONResponse:
    """Create a deployment from its spec (JSON); 409 when one of that name exists, 422 with the field at fault."""
    service = _service(request)
    deployment, _ = await service.apply(await _object(request), expected_generation=0)
    return JSONResponse(await service.view(deployment.name), status_code=201)


@router.post("/deployments/plan")
async def plan(request: Request) -> JSONResponse:
    """The replicas, and the hosts of the pool, a deployment document needs for a stated load, applying nothing:
    `{replicas, slots, sequences, seconds_per_request, target, decode: {tokens_per_s, source}, hosts: [{host,
    slots, context_per_slot}], refused: {host: [reason]}, shortfall, warnings}`. The answer speed of one sequence is
    `tokens_per_s` when given, else measured on the running fleet's replicas of the model; 422 `invalid_plan` when
    neither is known."""
    gateway = gateway_of(request)
    body: _PlanRequest = _model(_PlanRequest, await _object(request))
    name = body.spec.get("name")
    measured = gateway.metrics.decode_rate(name) if isinstance(name, str) else None
    if body.tokens_per_s is not None:
        decode = Decode(body.tokens_per_s, "stated")
    elif measured is not None:
        decode = Decode(measured[0], f"measured over {measured[1]} request(s) of the running fleet")
    else:
        raise AdminError(
            422,
            f"No replica of {name!r} has answered yet, so its speed is unknown: give it (answer tokens per second "
            "of one sequence).",
            "invalid_plan",
            "tokens_per_s",
        )
    load = Load(body.load.requests_per_s, body.load.prompt_tokens, body.load.answer_tokens)
    result = await gateway.deployments.plan(body.spec, load=load, decode=decode)
    return JSONResponse(
        {
            "name": name,
            "replicas": len(result.replicas),
            "slots": result.slots,
            "sequences": round(result.sequences, 3),
            "seconds_per_request": round(result.seconds_per_request, 3),
            "target": result.target,
            "decode": {"tokens_per_s": round(result.decode.tokens_per_s, 3), "source": result.decode.source},
            "hosts": [
                {"host": r.host, "slots": r.slots, "context_per_slot": r.context_per_slot} for r in result.replicas
            ],
            "refused": result.refused,
            "shortfall": result.shortfall,
            "warnings": result.warnings,
        }
    )


@router.get("/deployments/{name:path}/explain")
async def explain(request: Request, name: str) -> JSONResponse:
    """The last placement decision: `{at, template, wanted, hosts: [{host, eligible, chosen, score, reasons}]}`,
    or `{"explain": null}` before the controller placed anything."""
    service = _service(request)
    await service.store.get(name)
    status = await service.status(name)
    if status is None or status.explain is None:
        return JSONResponse({"explain": None})
    return JSONResponse(status.explain.model_dump(mode="json"))


@router.get("/deployments/{name:path}/events", response_class=StreamingResponse)
async def events(
    request: Request,
    name: str,
    follow: Annotated[bool, Query(description="Keep streaming new events.")] = True,
    after: Annotated[int, Query(ge=0, description="Only events with a sequence number above this.")] = 0,
    heartbeat_s: Annotated[float, Query(gt=0, le=300)] = 15.0,
) -> Response:
    """Server-sent events of a deployment: `event: deployment` with `{at, kind, message, host, seq}`, the kept ones
    first, then each new one as the controller records it (from any gateway sharing etcd); `event: gone` when the
    deployment is removed. The stream ends when the daemon shuts down."""
    service = _service(request)
    gateway = gateway_of(request)
    first = await service.events(name, after=after)

    async def stream() -> AsyncIterator[bytes]:
        ended = asyncio.Event()
        gateway.on_shutdown_begun.add(ended.set)
        try:
            seq = after
            for event in first:
                seq = event.seq
                yield _event(event.model_dump(mode="json"))
            quiet = 0.0
            while follow and not ended.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ended.wait(), 0.5)
                try:
                    fresh = await service.events(name, after=seq)
                except QiipError:  # the deployment is gone (or the store is down): say so and end
                    yield b"event: gone\ndata: {}\n\n"
                    return
                for event in fresh:
                    seq = event.seq
                    yield _event(event.model_dump(mode="json"))
                quiet = 0.0 if fresh else quiet + 0.5
                if quiet >= heartbeat_s:
                    quiet = 0.0
                    yield b": heartbeat\n\n"
        finally:
            gateway.on_shutdown_begun.discard(ended.set)

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)


def _event(data: dict[str, Any]) -> bytes:
    return b"event: deployment\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


@router.post("/deployments/{name:path}/scale")
async def scale(request: Request, name: str) -> JSONResponse:
    """Set the replica count: `{"replicas": N}` (0–1000), with `generation` as a precondition if given."""
    body: _Scale = _model(_Scale, await _object(request))
    service = _service(request)
    await service.scale(name, body.replicas, expected_generation=body.generation)
    return JSONResponse(await service.view(name))


@router.post("/deployments/{name:path}/rollout/undo")
async def rollout_undo(request: Request, name: str) -> JSONResponse:
    """Go back to the previous template (409 when there is none)."""
    body: _Undo = _model(_Undo, await _object(request))
    service = _service(request)
    await service.undo(name, expected_generation=body.generation)
    return JSONResponse(await service.view(name))


@router.post("/deployments/{name:path}/rollout")
async def rollout(request: Request, name: str) -> JSONResponse:
    """Roll out a new `source`, `engine` or `runtime` (any of them), with `generation` as a precondition if given."""
    data = await _object(request)
    generation = data.pop("generation", None)
    if generation is not None and (not isinstance(generation, int) or isinstance(generation, bool) or generation < 1):
        raise DeploymentInvalid(
            "generation must be a whole number from 1.", violations=[Violation("generation", "not a generation")]
        )
    service = _service(request)
    await service.rollout(name, data, expected_generation=generation)
    return JSONResponse(await service.view(name))


@router.get("/deployments/{name:path}")
async def get_deployment(request: Request, name: str) -> JSONResponse:
    """One deployment: `{name, generation, spec, template, history, deleting, status}` (404 when absent)."""
    return JSONResponse(await _service(request).view(name))


@router.put("/deployments/{name:path}")
async def put_deployment(request: Request, name: str, generation: _Generation = None) -> JSONResponse:
    """Create or replace a deployment from its spec (JSON); the body's `name`, if given, must be the path's.
    Answers 201 when created, 200 with `changed` false when the spec is the stored one."""
    data = await _object(request)
    if data.setdefault("name", name) != name:
        raise DeploymentInvalid(
            f"The body names deployment {data['name']!r} but the path {name!r}.",
            violations=[Violation("name", "differs from the path")],
        )
    service = _service(request)
    before = {d["name"] for d in await service.views()}
    deployment, changed = await service.apply(data, expected_generation=generation)
    view = await service.view(deployment.name)
    view["changed"] = changed
    return JSONResponse(view, status_code=201 if deployment.name not in before else 200)


@router.delete("/deployments/{name:path}", status_code=202)
async def delete_deployment(request: Request, name: str) -> JSONResponse:
    """Delete a deployment: its replicas are drained and torn down, then the record goes (follow its events)."""
    service = _service(request)
    deleted = await service.delete(name)
    try:
        view = await service.view(name)
    except DeploymentNotFound:  # it had no replica: the controller's pass removed the record already
        view = {**deleted.view(), "status": None}
    return JSONResponse(view, status_code=202)


@router.get("/hosts")
async def list_hosts(request: Request) -> JSONResponse:
    """The host pool: `{hosts: [{name, origin, labels, gpus, gpus_from, memory_mib, quads, occupant, engines, models,
    failure}]}`."""
    hosts = await _service(request).pool()
    return JSONResponse({"hosts": [h.view() for h in hosts]})


@router.post("/hosts", status_code=201)
async def add_host(request: Request) -> JSONResponse:
    """Add a host to the pool: `{name, labels?, gpus?: [{product, memory_mib, count}], memory_mib?}`."""
    try:
        host = await _service(request).add_host(await _object(request))
    except ValidationError as exc:
        error = first_violation(exc)
        field = error.field or "body"
        raise AdminError(422, f"Not a host: {field}: {error.message}.", "invalid_host", field) from None
    return JSONResponse(host.model_dump(mode="json"), status_code=201)


@router.delete("/hosts/{name}", status_code=204)
async def remove_host(request: Request, name: str) -> Response:
    """Remove an added host; a replica on it is moved to another host by its deployment."""
    await _service(request).remove_host(name)
    return Response(status_code=204)
