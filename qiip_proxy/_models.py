"""The admin API's models routes: `/admin/models/*` (the cache catalog, hub downloads, verified manifests).

Same rules as every admin route (`_admin.require_admin`: HTTP Basic, JSON for changes, strict bodies). A scan of
the cache runs in a thread; a degraded one (a repository huggingface_hub could not read) still answers 200, with
`degraded: true` in the body and `X-QIIP-Catalog-Degraded: true` in the headers, so a client that only looks at
headers cannot miss it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse

from qiip_core import ModelStoreError
from qiip_core.catalog import scan_catalog
from qiip_proxy._admin import AdminError, require_admin

if TYPE_CHECKING:
    from qiip_proxy._gateway import Gateway

__all__ = ["DEGRADED_HEADER", "router"]

DEGRADED_HEADER = "X-QIIP-Catalog-Degraded"
"""`true` when part of the cache could not be read and the catalog may be short."""

REPO_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$"
"""A hub repository id, `ORG/NAME` (the hub's own limit is 96 characters per part)."""

router = APIRouter(prefix="/admin/models", tags=["models"], dependencies=[Depends(require_admin)])


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DownloadRequest(_Strict):
    """`POST /admin/models/download`: fetch a repository (or some of its files) into the cache."""

    repo_id: str = Field(pattern=REPO_ID_PATTERN)
    """`ORG/NAME` on the hub."""
    revision: str | None = Field(default=None, min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._/-]+$")
    """A branch, tag or commit; `main` when absent. A branch or tag is resolved to its commit and recorded."""
    files: list[Annotated[str, Field(min_length=1, max_length=1024)]] | None = Field(default=None, max_length=10_000)
    """File names in the repository; all of them when absent or empty."""


@router.get("/catalog")
async def catalog(request: Request) -> JSONResponse:
    """The Hugging Face cache: GGUF generations (with the nodes serving each), full safetensors models, the
    entries not offered, counters, and whether the scan is degraded."""
    gateway = _gateway(request)
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
    download = _gateway(request).downloads.start(body.repo_id, revision=body.revision, files=body.files)
    return JSONResponse(download.view(), status_code=202)


@router.get("/downloads")
async def list_downloads(request: Request) -> JSONResponse:
    """Recent downloads, newest first, with bytes done and total, rate and ETA."""
    return JSONResponse({"downloads": [d.view() for d in _gateway(request).downloads.list()]})


@router.get("/downloads/{download_id}")
async def get_download(request: Request, download_id: str) -> JSONResponse:
    """One download."""
    download = _gateway(request).downloads.get(download_id)
    if download is None:
        raise AdminError(404, f"No download has id {download_id!r}.", "download_not_found", "download_id")
    return JSONResponse(download.view())
