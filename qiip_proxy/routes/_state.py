"""The admin API of the fleet's state: a backup taken, and one restored.

```
GET  /admin/state/backup                          the backup file (JSON, `Content-Disposition: attachment`)
POST /admin/state/restore?replace=&dry_run=       the backup file as the body → {target, where, dry_run,
                                                  refused, changes: {kind: {added, changed, removed, unchanged}}}
```

Both run the core's `qiip_core.state` on this daemon's backend (the state directory, or etcd), off the event loop.
A restore's body may reach `admin.max_restore_bytes` (64 MiB), checked from its `Content-Length` by the admin gate
once the credentials are, and counted again as it is read. A refused file answers 422 `invalid_backup`, a target
that holds state (without `replace`) or a running provisioning operation 409 `state_conflict`; nothing changes.
After a restore the daemon's stores pick the new state up as they pick up any change, its worker processes are
told the tokens changed, and the deployment controller looks at once.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import JSONResponse, Response

from qiip_core.state import restore, take_backup
from qiip_proxy._errors import body_too_large
from qiip_proxy.routes._admin import require_admin
from qiip_proxy.routes._common import gateway_of

__all__ = ["router"]

router = APIRouter(prefix="/admin/state", tags=["state"], dependencies=[Depends(require_admin)])


@router.get("/backup")
async def backup(request: Request) -> Response:
    """One moment's state of this daemon's backend, as a backup file (never a secret: tokens as their hashes)."""
    gateway = gateway_of(request)
    data, _ = await asyncio.to_thread(take_backup, gateway.settings)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    headers = {"Content-Disposition": f'attachment; filename="qiip-state-{stamp}.json"', "Cache-Control": "no-store"}
    return Response(data, media_type="application/json", headers=headers)


@router.post("/restore")
async def restore_state(
    request: Request,
    replace: Annotated[bool, Query(description="Replace a target that holds state.")] = False,
    dry_run: Annotated[bool, Query(description="Report what would change; change nothing.")] = False,
) -> JSONResponse:
    """Restore the backup file in the body into this daemon's backend: all of it, or nothing."""
    gateway = gateway_of(request)
    limit = gateway.settings.admin.max_restore_bytes
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit, "admin.max_restore_bytes")
        chunks.append(chunk)
    data = b"".join(chunks)
    report = await asyncio.to_thread(restore, gateway.settings, data, replace=replace, dry_run=dry_run)
    if not dry_run:
        if gateway.workers is not None:
            gateway.workers.tokens_changed()
        gateway.wake_controller()
    return JSONResponse(report.view())
