"""The admin API's models routes: `/admin/models/*` (the cache catalog, hub downloads, verified manifests).

Same rules as every admin route (`_admin.require_admin`: HTTP Basic, JSON for changes, strict bodies). A scan of
the cache runs in a thread; a degraded one (a repository huggingface_hub could not read) still answers 200, with
`degraded: true` in the body and `X-QIIP-Catalog-Degraded: true` in the headers, so a client that only looks at
headers cannot miss it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.responses import JSONResponse

from qiip_core import ModelStoreError, QiipError
from qiip_core.catalog import check_file_name, check_revision, scan_catalog
from qiip_proxy.routes._admin import AdminError, require_admin
from qiip_proxy.routes._common import gateway_of

if TYPE_CHECKING:
    from qiip_proxy._gateway import Gateway

__all__ = ["DEGRADED_HEADER", "router"]

DEGRADED_HEADER = "X-QIIP-Catalog-Degraded"
"""`true` when part of the cache could not be read and the catalog may be short."""

REPO_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$"
"""A hub repository id, `ORG/NAME` (the hub's own limit is 96 characters per part)."""

logger = logging.getLogger("qiip.proxy")

router = APIRouter(prefix="/admin/models", tags=["models"], dependencies=[Depends(require_admin)])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Empty(_Strict):
    """A body with no fields (`{}`)."""


class DownloadRequest(_Strict):
    """`POST /admin/models/download`: fetch a repository (or some of its files) into the cache."""

    repo_id: str = Field(pattern=REPO_ID_PATTERN)
    """`ORG/NAME` on the hub."""
    revision: str | None = Field(default=None, min_length=1, max_length=255)
    """A branch, tag or commit; `main` when absent. A branch or tag is resolved to its commit and recorded
    (`check_revision`: git's ref-name rules, or 40 hex)."""
    files: list[Annotated[str, Field(min_length=1, max_length=1024)]] | None = Field(default=None, max_length=10_000)
    """File names in the repository, relative paths inside it; all of them when absent or empty."""

    @field_validator("revision")
    @classmethod
    def _revision(cls, value: str | None) -> str | None:
        return None if value is None else check_revision(value)

    @field_validator("files")
    @classmethod
    def _files(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else [check_file_name(name) for name in value]


@router.get("/catalog")
async def catalog(request: Request) -> JSONResponse:
    """The Hugging Face cache: GGUF generations (with the nodes serving each), full safetensors models, the
    entries not offered, counters, and whether the scan is degraded."""
    gateway = gateway_of(request)
    try:
        scanned = await asyncio.to_thread(scan_catalog, gateway.cache_dir)
    except OSError as exc:
        raise ModelStoreError(f"The Hugging Face cache {gateway.cache_dir} cannot be read: {exc}.") from exc
    serving: dict[str, list[str]] = {}
    for state in gateway.table:
        if state.node.artifact_id:
            serving.setdefault(state.node.artifact_id, []).append(state.id)
    view: dict[str, Any] = scanned.view()
    for generation in view["gguf"]:
        generation["nodes"] = sorted(serving.get(generation["artifact_id"], []))
    headers = {DEGRADED_HEADER: "true" if scanned.degraded else "false"}
    return JSONResponse(view, headers=headers)


@router.post("/download", status_code=202)
async def start_download(request: Request, body: DownloadRequest) -> JSONResponse:
    """Start a download (202), or join the running one for the same repository, revision and files."""
    download = gateway_of(request).downloads.start(body.repo_id, revision=body.revision, files=body.files)
    return JSONResponse(download.view(), status_code=202)


@router.get("/downloads")
async def list_downloads(request: Request) -> JSONResponse:
    """Recent downloads, newest first, with bytes done and total, rate and ETA."""
    return JSONResponse({"downloads": [d.view() for d in gateway_of(request).downloads.list()]})


@router.get("/downloads/{download_id}")
async def get_download(request: Request, download_id: str) -> JSONResponse:
    """One download."""
    download = gateway_of(request).downloads.get(download_id)
    if download is None:
        raise AdminError(404, f"No download has id {download_id!r}.", "download_not_found", "download_id")
    return JSONResponse(download.view())


def _revision_or_404(gateway: Gateway, revision_id: str) -> None:
    gateway.model_store.get(revision_id)


@router.post("/manifests")
async def register_manifest(request: Request, body: dict[str, Any]) -> JSONResponse:
    """Register a model revision from its manifest: 201 when new, 200 when the same manifest was registered
    already; 422 with `violations`; 409 when another manifest holds the same source and revision."""
    store = gateway_of(request).model_store
    manifest, new = await asyncio.to_thread(store.register, body)
    status = await asyncio.to_thread(store.status, manifest.id)
    return JSONResponse(status.view(), status_code=201 if new else 200)


@router.get("/manifests")
async def list_manifests(request: Request) -> JSONResponse:
    """Every registered revision with its acquisition state and bytes done."""
    store = gateway_of(request).model_store

    def views() -> list[dict[str, Any]]:
        return [store.status(m.id).view() for m in store.manifests()]

    return JSONResponse({"revisions": await asyncio.to_thread(views)})


@router.get("/manifests/{revision_id}")
async def get_manifest(request: Request, revision_id: str) -> JSONResponse:
    """One registered revision (404 when unknown)."""
    status = await asyncio.to_thread(gateway_of(request).model_store.status, revision_id)
    return JSONResponse(status.view())


@router.post("/manifests/{revision_id}/acquire", status_code=202)
async def acquire(request: Request, revision_id: str, body: Empty) -> JSONResponse:
    """Acquire (or resume) every file over HTTPS in the background: 202 with the revision; joins a running one."""
    gateway = gateway_of(request)
    await asyncio.to_thread(_revision_or_404, gateway, revision_id)
    running = gateway.acquisitions.get(revision_id)
    if running is None or running.done():
        task = asyncio.create_task(_acquire(gateway, revision_id), name=f"qiip-acquire-{revision_id}")
        gateway.acquisitions[revision_id] = task
        await asyncio.sleep(0)  # let it register as active before the status is read
    status = await asyncio.to_thread(gateway.model_store.status, revision_id)
    return JSONResponse(status.view(), status_code=202)


async def _acquire(gateway: Gateway, revision_id: str) -> None:
    try:
        await asyncio.to_thread(gateway.model_store.acquire, revision_id)
    except QiipError as exc:
        logger.warning("acquisition of %s stopped: %s", revision_id, exc.message)


@router.post("/manifests/{revision_id}/pause")
async def pause(request: Request, revision_id: str, body: Empty) -> JSONResponse:
    """Pause an acquisition at its next chunk; its offset stays durable and `acquire` resumes it."""
    status = await asyncio.to_thread(gateway_of(request).model_store.pause, revision_id)
    return JSONResponse(status.view())


@router.post("/manifests/{revision_id}/verify")
async def verify(request: Request, revision_id: str, body: Empty) -> JSONResponse:
    """Hash every object of the revision again: `{"ok": bool, "files": {name: matches}}`."""
    files = await asyncio.to_thread(gateway_of(request).model_store.verify, revision_id)
    return JSONResponse({"ok": all(files.values()), "files": files})
