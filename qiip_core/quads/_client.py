"""The QUADS REST client (`/api/v3`, reads only): GPU hosts, availability, and each host's schedules.

Every failure (no connection, a timeout, an error answer `{status_code, error, message}`, a body of another
shape) is a `QuadsUnavailable`: callers never see an httpx exception.

A broken or hostile server costs a bounded amount: an answer larger than `MAX_ANSWER_BYTES` is refused while it is
read (never held whole), every request ends within `timeout_s` in total however slowly the server sends, and at
most `max_concurrent` requests are in flight at once, whoever asks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any
from urllib.parse import quote
from zoneinfo import ZoneInfo

import httpx
from pydantic import TypeAdapter, ValidationError

from qiip_core._errors import QuadsUnavailable, safe_text
from qiip_core._violation import first_violation
from qiip_core.config import QuadsSettings
from qiip_core.nodes import IPNetwork, checked_async_transport
from qiip_core.quads._models import (
    QuadsHost,
    Reservation,
    WireHost,
    WireSchedule,
    normalise_host,
    server_time,
)

__all__ = ["MAX_ANSWER_BYTES", "QuadsClient"]

MAX_ANSWER_BYTES = 16 * 1024 * 1024
"""The largest QUADS answer read, in bytes: a `/hosts` of a few thousand hosts is well under 16 MiB."""

_HOSTS = TypeAdapter(list[WireHost])
_NAMES = TypeAdapter(list[str])
_SCHEDULES = TypeAdapter(list[WireSchedule])
_AVAILABLE_ONE = TypeAdapter(dict[str, str | bool])


class QuadsClient:
    """Reads one QUADS server.

    Args:
        base_url: the server's base URL; the API is under `<base_url>/api/v3`.
        timezone: the server's IANA timezone (QUADS' naive times are its local times).
        timeout_s: deadline of one whole request (connect, send, read the answer), in seconds.
        transport: an httpx transport (tests); None: the network, every connection held to the address rule
            (`checked_async_transport`: a name that resolves to a link-local, unspecified or metadata address is
            refused when it is connected to).
        max_answer_bytes: the largest answer read, in bytes.
        max_concurrent: requests in flight at once.
        networks: `routing.allowed_endpoint_networks`: addresses the rule allows although it would refuse them.
    """

    def __init__(
        self,
        base_url: str,
        timezone: str,
        *,
        timeout_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        max_concurrent: int = 8,
        networks: Iterable[IPNetwork] = (),
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.tz = ZoneInfo(timezone)
        self.timeout_s = timeout_s
        self.max_answer_bytes = max_answer_bytes
        self._slots = asyncio.Semaphore(max_concurrent)
        self._http = httpx.AsyncClient(
            base_url=self.base_url + "/api/v3",
            timeout=httpx.Timeout(timeout_s),
            # Every connection passes the address rule, the name resolved at connect time (qiip_core.nodes).
            transport=transport or checked_async_transport(setting="quads.url", networks=networks),
            headers={"Accept": "application/json"},
            follow_redirects=False,
            trust_env=False,  # as for the nodes and the BMCs: proxy variables never apply
        )

    @classmethod
    def from_settings(cls, settings: QuadsSettings, *, networks: Iterable[IPNetwork] = ()) -> QuadsClient:
        """A client for `[quads]` (which must be enabled); `networks` is `routing.allowed_endpoint_networks`."""
        assert settings.url is not None and settings.timezone is not None
        return cls(
            settings.url,
            settings.timezone,
            timeout_s=settings.timeout_s,
            max_answer_bytes=settings.max_answer_bytes,
            max_concurrent=settings.max_concurrent_requests,
            networks=networks,
        )

    async def _get(self, path: str, params: Mapping[str, str] | None = None) -> tuple[int, Any]:
        async with self._slots:
            try:
                async with asyncio.timeout(self.timeout_s):
                    status, raw = await self._read(path, params)
            except (httpx.TimeoutException, TimeoutError):
                raise QuadsUnavailable(
                    f"QUADS at {self.base_url} did not answer {path} within {self.timeout_s:g} s (quads.timeout_s)."
                ) from None
            except httpx.HTTPError as exc:
                raise QuadsUnavailable(
                    f"QUADS at {self.base_url} cannot be reached ({type(exc).__name__}: {safe_text(str(exc) or '-')})."
                ) from None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise QuadsUnavailable(
                f"QUADS at {self.base_url} answered {path} with {status} and a body that is not JSON."
            ) from None
        return status, body

    async def _read(self, path: str, params: Mapping[str, str] | None) -> tuple[int, bytes]:
        async with self._http.stream("GET", path, params=dict(params or {})) as response:
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.max_answer_bytes:
                raise self._too_large(path)
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > self.max_answer_bytes:
                    raise self._too_large(path)
                chunks.append(chunk)
            return response.status_code, b"".join(chunks)

    def _too_large(self, path: str) -> QuadsUnavailable:
        return QuadsUnavailable(
            f"QUADS at {self.base_url} answered {path} with more than {self.max_answer_bytes:,} bytes; it was not read."
        )

    def _refused(self, path: str, status: int, body: Any) -> QuadsUnavailable:
        message = body.get("message") if isinstance(body, dict) else None
        return QuadsUnavailable(
            f"QUADS at {self.base_url} refused {path} ({status}"
            + (f": {safe_text(str(message))}" if message else "")
            + ")."
        )

    def _shape(self, path: str, exc: ValidationError) -> QuadsUnavailable:
        first = first_violation(exc)
        return QuadsUnavailable(
            f"QUADS at {self.base_url} answered {path} with another shape ({first.field or 'body'}: {first.message})."
        )

    async def hosts(self) -> list[QuadsHost]:
        """Every host QUADS knows (`GET /hosts`), broken, retired and GPU-less ones included (`QuadsHost.usable`,
        `gpu_count`), sorted by name."""
        status, body = await self._get("/hosts")
        if status != 200:
            raise self._refused("/hosts", status, body)
        try:
            wire = _HOSTS.validate_python(body)
        except ValidationError as exc:
            raise self._shape("/hosts", exc) from None
        return sorted((QuadsHost.from_wire(h) for h in wire), key=lambda h: h.name)

    async def host(self, name: str) -> QuadsHost | None:
        """One host as QUADS knows it now (`GET /hosts/<name>`); None for a host QUADS does not know."""
        path = f"/hosts/{quote(name, safe='')}"
        status, body = await self._get(path)
        if status in (400, 404) and isinstance(body, dict) and "not found" in str(body.get("message", "")).lower():
            return None
        if status != 200:
            raise self._refused(path, status, body)
        try:
            wire = WireHost.model_validate(body)
        except ValidationError as exc:
            raise self._shape(path, exc) from None
        return QuadsHost.from_wire(wire)

    async def available(self, *, start: datetime, end: datetime) -> set[str]:
        """The hosts free of every schedule from `start` to `end` (`GET /available`), names normalised. Both are
        aware datetimes, sent in the server's local time.

        All three of `start`, `end` and `cloud` (empty: any) are always sent: some QUADS releases read them without
        a default and answer 500 when one is missing.
        """
        params = {"start": server_time(start, self.tz), "end": server_time(end, self.tz), "cloud": ""}
        status, body = await self._get("/available", params)
        if status != 200:
            raise self._refused("/available", status, body)
        try:
            names = _NAMES.validate_python(body)
        except ValidationError as exc:
            raise self._shape("/available", exc) from None
        return {normalise_host(n) for n in names}

    async def reservations(
        self, host: str, *, now: datetime | None = None, quads_name: str | None = None
    ) -> list[Reservation]:
        """The host's current and future schedules (`GET /schedules/current?host=` and `/schedules/future?host=`),
        in UTC, sorted by start. A host QUADS does not know has none.

        Args:
            host: the host's name (normalised here).
            now: the moment "current" means (default: QUADS' now).
            quads_name: the name as QUADS spells it, when it differs (`QuadsHost.quads_name`).
        """
        host = normalise_host(host)
        asked = quads_name or host
        current_params = {"host": asked}
        if now is not None:
            current_params["date"] = server_time(now, self.tz)
        current, future = await asyncio.gather(
            self._schedules("/schedules/current", current_params, host),
            self._schedules("/schedules/future", {"host": asked}, host),
        )
        by_id = {r.id: r for r in current + future}
        return sorted(by_id.values(), key=lambda r: (r.start, r.id))

    async def _schedules(self, path: str, params: dict[str, str], host: str) -> list[Reservation]:
        status, body = await self._get(path, params)
        if status == 400 and isinstance(body, dict) and "not found" in str(body.get("message", "")).lower():
            return []  # QUADS answers an unknown host with 400 "Host not found"
        if status != 200:
            raise self._refused(path, status, body)
        try:
            wire = _SCHEDULES.validate_python(body)
        except ValidationError as exc:
            raise self._shape(path, exc) from None
        # QUADS ignores a host it does not know and lists every host's schedules: keep this host's only.
        return [
            Reservation.from_wire(s, host, self.tz)
            for s in wire
            if s.host is None or normalise_host(s.host.name) == host
        ]

    async def aclose(self) -> None:
        await self._http.aclose()
