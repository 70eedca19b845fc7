"""The provisioning routes of the admin API: setups, their tasks and live logs, cancellation.

```
POST /admin/nodes/setup                  {hostname, engine, model | artifact_id, managed, alias?, sizing?} → 202
GET  /admin/provisioning/tasks           every host's task record (host, kind, state, step, elapsed, error)
GET  /admin/provisioning/{host}/logs     SSE: the host's log kept so far, then every new entry (`event: log`)
POST /admin/provisioning/{host}/cancel   stop the host's running operation and its remote command → 202
GET  /admin/nodes/{host}/power           the host's power state through its BMC (DMTF Redfish)
POST /admin/nodes/{host}/power           {action: On|ForceOff|GracefulRestart|ForceRestart}: ComputerSystem.Reset
GET  /admin/nodes/{host}/recommendations ?profile=&limit=: what llmfit recommends for the host, best first
DELETE /admin/nodes/{host}/host-key      remove the host's entries from the known-hosts file (a re-imaged host)
```

Teardown is `DELETE /admin/nodes/{id}` (`_admin`), which hands provisioned nodes to the provisioner. Every refusal
comes before any power or SSH work: 400 `invalid_setup` with the field for a body that is not a setup (the model's
name or path, its presence in the shared cache, the alias, the sizing: `qiip_core.provisioning.check_setup_request`),
400 for a host outside the allowlist, 400 `host_reserved` for a host QUADS reserves within `quads.lookahead_s`,
marks broken or retired, 503 `quads_unavailable` when QUADS is
configured but cannot be read, 409 while another operation holds the host's lease, 429 above the
concurrent-setup limit. A power action is refused with 400
(an action or host outside the allowlist) before any name is resolved, runs under the host's lease (409 during its
setup), and maps the BMC's failures: 404 no system, 409 no BMC configured or an unsupported reset type, 502 the BMC
unreachable or refusing the credentials, 504 the BMC silent past `redfish.timeout_s`. Recommendations are refused
with 400 for a host outside the allowlist and 404 for a name that does not resolve, and answer 502 when SSH or
llmfit fails (with the reason), 503 when the gateway's environment lacks llmfit, and 504 past
`provisioning.llmfit_timeout_s`.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse

from qiip_core import ModelStoreError, PlanError
from qiip_core._violation import first_violation
from qiip_core.catalog import resolve_artifact, scan_catalog
from qiip_core.nodes import Engine, ProvisionedEngine
from qiip_core.planner import parse_policy
from qiip_core.provisioning import LogEntry, ResetType, SetupRequest
from qiip_core.recommendations import DEFAULT_LIMIT, MAX_LIMIT, PROFILE_PATTERN, catalog_repos
from qiip_proxy.routes._admin import AdminError, require_admin
from qiip_proxy.routes._common import gateway_of
from qiip_proxy.routes._log_stream import kept_then_live

if TYPE_CHECKING:
    from qiip_proxy._gateway import Gateway

__all__ = ["PowerBody", "SetupBody", "router"]

router = APIRouter(prefix="/admin", tags=["provisioning"], dependencies=[Depends(require_admin)])


class SetupBody(BaseModel):
    """`POST /admin/nodes/setup`: what to set up on a host."""

    model_config = ConfigDict(extra="forbid")

    hostname: str = Field(min_length=1, max_length=253)
    """The host: a name or address inside the node allowlist; it becomes the node's id."""
    engine: ProvisionedEngine
    """The engine to install and start."""
    model: str | None = Field(default=None, min_length=1, max_length=512)
    """vLLM: the model (a Hugging Face repo id); llama.cpp and Ollama: the GGUF's path in the shared model cache.
    Give it or `artifact_id`."""
    artifact_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """llama.cpp and Ollama: a GGUF generation of the shared model cache (`provisioning.model_cache_dir`, a Hugging Face
    cache), by its catalog id, instead of `model`."""
    managed: bool = True
    """Register the node as managed (leased, torn down by QIIP)."""
    alias: str | None = Field(default=None, min_length=1, max_length=512)
    """The model name clients send (default: `model`); for Ollama also its name on the daemon (`name[:tag]`), and
    required."""
    sizing: dict[str, Any] | None = None
    """The sizing policy of llama.cpp or Ollama (`{"sizing": "auto"}` by default, or a custom one)."""


class PowerBody(BaseModel):
    """`POST /admin/nodes/{host}/power`: the reset to ask the host's BMC for."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["On", "ForceOff", "GracefulRestart", "ForceRestart"]
    """The DMTF Redfish `ResetType` of `ComputerSystem.Reset`."""


async def _setup_model(gateway: Gateway, body: SetupBody) -> str:
    """The model a setup serves: `model`, or the path of `artifact_id`'s entrypoint in the shared model cache.

    Raises:
        AdminError: 400 for neither or both, or an artifact for vLLM; 409 without `provisioning.model_cache_dir`.
        ArtifactNotFound: no complete generation of the shared cache has this id (404).
    """
    if (body.model is None) == (body.artifact_id is None):
        raise AdminError(400, "A setup names its model: give `model` or `artifact_id`, not both.", "invalid_setup")
    if body.artifact_id is None:
        assert body.model is not None
        return body.model
    if not body.engine.serves_gguf:
        raise AdminError(
            400,
            "`artifact_id` names a GGUF generation: it serves llama.cpp and Ollama setups only.",
            "invalid_setup",
            "engine",
        )
    cache = gateway.settings.provisioning.model_cache_dir
    if cache is None:
        raise AdminError(
            409,
            "A setup by artifact_id needs provisioning.model_cache_dir: this gateway's view of the shared cache.",
            "model_cache_not_configured",
        )
    return await asyncio.to_thread(_path_in_cache, body.artifact_id, cache)


def _path_in_cache(artifact: str, cache: Path) -> str:
    """The path of `artifact`'s entrypoint inside `cache`: the hosts mount the same cache at
    `provisioning.node_model_dir`, so the path inside it is the same there."""
    return os.path.relpath(resolve_artifact(artifact, cache), cache)


@router.post("/nodes/setup", status_code=202)
async def setup_node(request: Request) -> JSONResponse:
    """Set a host up as a node (202: follow the operation, the task and the host's log). 400 for a body that is not
    a setup, a host outside the allowlist or one QUADS reserves within the lookahead, 503 when QUADS cannot be
    read, 409 while the host is busy, 429 above the concurrent-setup limit."""
    gateway = gateway_of(request)
    try:
        body = SetupBody.model_validate_json(await request.body())
        sizing = parse_policy(body.sizing) if body.sizing is not None else None
    except ValidationError as exc:
        error = first_violation(exc)
        field = error.field or None
        raise AdminError(
            400, f"Not a setup request: {field or 'body'}: {error.message}.", "invalid_setup", field
        ) from None
    except PlanError as exc:
        field = f"sizing.{exc.violations[0].field}" if exc.violations else "sizing"
        raise AdminError(400, f"Not a setup request: {exc.message}", "invalid_setup", field) from None
    if body.engine is Engine.OLLAMA and body.alias is None:
        # The alias is the model's name on the daemon; a cache path (the default) is never a name Ollama takes.
        raise AdminError(
            400,
            "Not a setup request: alias: an Ollama setup names its model on the daemon: give `alias` "
            "(`name[:tag]`, such as qwen3-8b:q4_k_m); it does not default to the model's path.",
            "invalid_setup",
            "alias",
        )
    model = await _setup_model(gateway, body)
    if gateway.quads is not None:
        # QUADS lends the host: refuse it while reserved within the lookahead (400), or when QUADS cannot say
        # (503), before any power or SSH work. The allowlist check comes first, so no name outside it is sent.
        await gateway.quads.check_setup(gateway.provisioner.check_host(body.hostname))
    setup = SetupRequest(
        hostname=body.hostname,
        engine=body.engine,
        model=model,
        alias=body.alias or body.model or model,
        managed=body.managed,
        sizing=sizing,
        artifact_id=body.artifact_id,
    )
    operation = await gateway.provisioner.start_setup(setup)
    return JSONResponse({**operation.view(), "task_id": operation.id}, status_code=202)


@router.get("/nodes/{host}/power")
async def power_state(request: Request, host: str) -> JSONResponse:
    """The host's power state through its BMC: `{host, system_id, power_state}` (400 outside the allowlist, 409 no
    BMC configured, 404 no system, 502 the BMC unreachable or refusing the credentials, 504 it did not answer)."""
    status = await gateway_of(request).provisioner.power_state(host)
    return JSONResponse(status.view())


@router.post("/nodes/{host}/power")
async def power_action(request: Request, host: str) -> JSONResponse:
    """Ask the host's BMC for a reset (DMTF Redfish `ComputerSystem.Reset`); the power state changes some seconds
    later. Answers `{host, system_id, action, power_state_before}`; 400 for another action or a host outside the
    allowlist, 409 while the host is busy (a setup) or for a reset type the system does not offer."""
    try:
        body = PowerBody.model_validate_json(await request.body())
    except ValidationError as exc:
        error = first_violation(exc)
        field = error.field or None
        raise AdminError(
            400, f"Not a power action: {field or 'body'}: {error.message}.", "invalid_power_action", field
        ) from None
    status = await gateway_of(request).provisioner.power(host, ResetType(body.action))
    return JSONResponse(
        {
            "host": status.host,
            "system_id": status.system_id,
            "action": body.action,
            "power_state_before": status.power_state,
        }
    )


@router.get("/nodes/{host}/recommendations")
async def recommendations(
    request: Request,
    host: str,
    profile: Annotated[
        str | None,
        Query(
            pattern=PROFILE_PATTERN,
            description="An llmfit hardware profile (`llmfit hardware list`) or a profile file's path on the host, "
            "scored against instead of the host's own hardware.",
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="How many recommendations.")] = DEFAULT_LIMIT,
) -> JSONResponse:
    """What the host can run well, as llmfit scores its model database against the host's hardware (or `profile`):
    `{host, profile, llmfit_version, system, recommendations: [...]}`, best first, each marked `in_catalog` when its
    repository is exactly a model of the catalog. llmfit is installed on the host first when missing or altered.
    400 outside the allowlist, 404 a name that does not resolve, 502 SSH or llmfit failing, 503 no llmfit in the
    gateway's environment, 504 past `provisioning.llmfit_timeout_s`."""
    gateway = gateway_of(request)
    gateway.provisioner.check_host(host)  # refuse before scanning the cache
    try:
        catalog = await asyncio.to_thread(scan_catalog, gateway.cache_dir)
        repos: frozenset[str] = catalog_repos(catalog)
    except OSError as exc:
        raise ModelStoreError(f"The Hugging Face cache {gateway.cache_dir} cannot be read: {exc}.") from exc
    found = await gateway.recommender.recommend(host, profile=profile, limit=limit, catalog_repos=repos)
    return JSONResponse(found.model_dump(mode="json"))


@router.delete("/nodes/{host}/host-key")
async def forget_host_key(request: Request, host: str) -> JSONResponse:
    """Remove the host's entries from the known-hosts file (`provisioning.known_hosts_file`), as after a re-install
    its key changed and SSH refuses it: `{host, removed}` (0 when it had none). 400 outside the allowlist."""
    provisioner = gateway_of(request).provisioner
    name = provisioner.check_host(host)
    return JSONResponse({"host": name, "removed": await provisioner.forget_host_key(name)})


@router.get("/provisioning/tasks")
async def list_tasks(request: Request) -> JSONResponse:
    """Every host's last provisioning task: host, kind, engine, state, current and failed step, elapsed, error."""
    tasks = await gateway_of(request).provisioner.tasks()
    return JSONResponse({"tasks": [t.view() for t in tasks]})


@router.post("/provisioning/{host}/cancel", status_code=202)
async def cancel(request: Request, host: str) -> JSONResponse:
    """Cancel the operation running on `host`: its remote command is stopped and the host's lease released (404
    when none runs here)."""
    operation = gateway_of(request).provisioner.cancel(host)
    return JSONResponse(operation.view(), status_code=202)


@router.get("/provisioning/{host}/logs", response_class=StreamingResponse)
async def logs(
    request: Request,
    host: str,
    follow: Annotated[bool, Query(description="Keep streaming new entries (false: the kept ones, then end).")] = True,
    heartbeat_s: Annotated[float, Query(gt=0, le=300, description="Seconds between heartbeat comments.")] = 15.0,
) -> Response:
    """Server-sent events of a host's provisioning log: `event: log` with `{ts, level, msg, stream, step}`, first the
    entries kept, then each new one, and `: heartbeat` when idle. The stream ends when the daemon shuts down. 404
    for a host with no task record and no log: nothing is kept for it."""
    gateway = gateway_of(request)
    provisioner = gateway.provisioner
    if not provisioner.logs.entries(host) and not await provisioner.is_provisioned(host):
        raise AdminError(404, f"Host {host!r} has no provisioning task or log.", "host_not_found", "host")

    return kept_then_live(gateway, provisioner.logs.follow(host), _event, follow=follow, heartbeat_s=heartbeat_s)


def _event(entry: LogEntry) -> bytes:
    return b"event: log\ndata: " + json.dumps(entry.view(), separators=(",", ":")).encode() + b"\n\n"
