"""A QUADS server on loopback for tests: the reads of QUADS' REST API (`/api/v3`) with its real shapes, over HTTP.

It follows QUADS (redhat-performance/quads, `server/blueprints`, `server/dao/schedule.py`):

- `GET /hosts`: hosts with `cloud`/`default_cloud` only when set and `processors` only when non-empty
  (`{id, handle, vendor, product, cores, threads, processor_type: "CPU"|"GPU", host_id}`); `/hosts/<name>`.
- `GET /available?start&end`: hostnames free over the span; both default to the server's now; `start > end`
  makes `end = start + 1 min`; a host is free iff it exists, is neither broken nor retired, and no schedule
  overlaps (`s.start <= start < s.end`, `s.start < end <= s.end`, or `start < s.start and end > s.end`).
- `GET /available/<host>`: `{"<host>": "True"|"False"}` (QUADS adds a minute to a given start there).
- `GET /schedules?host=` (400 for an unknown host), `/schedules/current?host&date` (`start <= date <= end`),
  `/schedules/future?host` (`end >= now`, as QUADS' DAO has it), each schedule with its assignment (and cloud) and
  host. The last two, given a host they do not know, list every host's schedules, as QUADS does.
- Datetimes in JSON as RFC 1123 labelled GMT but in the server's local time (Flask's encoding of QUADS' naive
  local datetimes); query datetimes naive `%Y-%m-%dT%H:%M` in the server's local time, the zone `timezone`.
- Errors as `{status_code, error, message}`; not found is 400.

The clock is the test's: `server.now` (aware) is QUADS' now (None: the real time). `stop()` and `start()` take
the server down and bring it back on the same port; `requests` records each request's path and query.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.support.daemon import free_port

__all__ = ["QuadsServer", "rfc1123"]

QUERY_FORMAT = "%Y-%m-%dT%H:%M"
_CREATED = datetime(2024, 1, 1, 0, 0)


def rfc1123(naive: datetime) -> str:
    """How QUADS' JSON encoder writes a naive datetime: RFC 1123, labelled GMT whatever its zone."""
    days = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
    months = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
    return (
        f"{days[naive.weekday()]}, {naive.day:02d} {months[naive.month - 1]} {naive.year} "
        f"{naive.hour:02d}:{naive.minute:02d}:{naive.second:02d} GMT"
    )


@dataclass
class _Host:
    id: int
    name: str
    gpus: int
    gpu_vendor: str
    gpu_product: str
    broken: bool = False
    retired: bool = False
    cloud: str | None = "cloud01"
    model: str = "R750"

    def as_dict(self, clouds: dict[str, int]) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": self.id,
            "name": self.name,
            "model": self.model,
            "host_type": "baremetal",
            "build": False,
            "validated": True,
            "switch_config_applied": True,
            "broken": self.broken,
            "retired": self.retired,
            "last_build": None,
            "created_at": rfc1123(_CREATED),
            "cloud_id": clouds.get(self.cloud) if self.cloud else None,
            "default_cloud_id": 1,
            "can_self_schedule": False,
        }
        if self.cloud:
            data["cloud"] = {"id": clouds[self.cloud], "name": self.cloud, "last_redefined": rfc1123(_CREATED)}
            data["default_cloud"] = {"id": 1, "name": "cloud01", "last_redefined": rfc1123(_CREATED)}
        processors = [
            {
                "id": self.id * 100,
                "handle": "CPU.Socket.1",
                "vendor": "Intel",
                "product": "Xeon Gold 6338",
                "cores": 32,
                "threads": 64,
                "processor_type": "CPU",
                "host_id": self.id,
            }
        ]
        processors += [
            {
                "id": self.id * 100 + 1 + i,
                "handle": f"GPU.Slot.{i + 1}",
                "vendor": self.gpu_vendor,
                "product": self.gpu_product,
                "cores": 0,
                "threads": 0,
                "processor_type": "GPU",
                "host_id": self.id,
            }
            for i in range(self.gpus)
        ]
        data["processors"] = processors
        return data


@dataclass
class _Schedule:
    id: int
    host: _Host
    start: datetime  # naive, server-local
    end: datetime
    cloud: str
    owner: str
    ticket: str
    description: str

    def as_dict(self, clouds: dict[str, int]) -> dict[str, Any]:
        cloud_id = clouds[self.cloud]
        return {
            "id": self.id,
            "start": rfc1123(self.start),
            "end": rfc1123(self.end),
            "build_start": None,
            "build_end": None,
            "created_at": rfc1123(_CREATED),
            "assignment_id": self.id + 1000,
            "host_id": self.host.id,
            "move_status": None,
            "move_message": None,
            "move_error": None,
            "assignment": {
                "id": self.id + 1000,
                "active": True,
                "provisioned": True,
                "validated": True,
                "description": self.description,
                "owner": self.owner,
                "ticket": self.ticket,
                "qinq": 0,
                "wipe": True,
                "ccuser": [],
                "is_self_schedule": False,
                "created_at": rfc1123(_CREATED),
                "cloud_id": cloud_id,
                "cloud": {"id": cloud_id, "name": self.cloud, "last_redefined": rfc1123(_CREATED)},
                "vlan_id": None,
            },
            "host": {"id": self.host.id, "name": self.host.name, "model": self.host.model},
        }


def _error(status: int, message: str) -> JSONResponse:
    names = {400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}
    return JSONResponse({"status_code": status, "error": names.get(status, "Error"), "message": message}, status)


class _BadDate(ValueError):
    pass


@dataclass
class QuadsServer:
    """QUADS on 127.0.0.1 and a free port, in a thread. Use as a context manager.

    Args:
        timezone: the server's local zone (its naive times).
        now: QUADS' now (aware), which tests move; None: the real time.
    """

    timezone: str = "UTC"
    now: datetime | None = None
    hosts: dict[str, _Host] = field(default_factory=dict)
    schedules: list[_Schedule] = field(default_factory=list)
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    delay_s: float = 0.0
    """Seconds each answer takes (requests then overlap, and `max_in_flight` counts how many did at once)."""
    in_flight: int = 0
    max_in_flight: int = 0

    def __post_init__(self) -> None:
        self.tz = ZoneInfo(self.timezone)
        self._clouds: dict[str, int] = {"cloud01": 1}
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- what QUADS knows -------------------------------------------------------------------------------------

    def local(self, moment: datetime) -> datetime:
        """An aware moment as the server's naive local time."""
        return moment.astimezone(self.tz).replace(tzinfo=None)

    def local_now(self) -> datetime:
        return self.local(self.now or datetime.now(UTC))

    def add_host(
        self,
        name: str,
        *,
        gpus: int = 4,
        vendor: str = "NVIDIA",
        product: str = "H100 80GB HBM3",
        broken: bool = False,
        retired: bool = False,
        cloud: str | None = "cloud01",
    ) -> None:
        with self._lock:
            if cloud is not None:
                self._clouds.setdefault(cloud, len(self._clouds) + 1)
            self.hosts[name] = _Host(len(self.hosts) + 1, name, gpus, vendor, product, broken, retired, cloud)

    def reserve(
        self,
        host: str,
        start: datetime,
        end: datetime,
        *,
        cloud: str = "cloud02",
        owner: str = "alice",
        ticket: str = "4242",
        description: str = "perf lab run",
    ) -> int:
        """Schedule `host` (known) from `start` to `end` (aware, kept to the minute as QUADS takes them); returns
        the schedule's id."""
        with self._lock:
            self._clouds.setdefault(cloud, len(self._clouds) + 1)
            schedule_id = len(self.schedules) + 1
            self.schedules.append(
                _Schedule(
                    schedule_id,
                    self.hosts[host],
                    self.local(start).replace(second=0, microsecond=0),
                    self.local(end).replace(second=0, microsecond=0),
                    cloud,
                    owner,
                    ticket,
                    description,
                )
            )
            return schedule_id

    def clear_schedules(self) -> None:
        with self._lock:
            self.schedules.clear()

    def queries(self, path: str) -> list[dict[str, str]]:
        """The query of each request to `path` (under `/api/v3`), oldest first."""
        return [q for p, q in self.requests if p == path]

    # -- the API ----------------------------------------------------------------------------------------------

    def _date(self, params: dict[str, str], name: str) -> datetime | None:
        value = params.get(name)
        if not value:
            return None
        try:
            return datetime.strptime(value, QUERY_FORMAT)
        except ValueError:
            raise _BadDate(f"Invalid date format for {name}, correct format: 'YYYY-MM-DDTHH:MM'") from None

    def _is_available(self, host: _Host | None, start: datetime, end: datetime) -> bool:
        if host is None or host.broken or host.retired:
            return False
        for s in self.schedules:
            if s.host is not host:
                continue
            if s.start <= start < s.end or s.start < end <= s.end or (start < s.start and end > s.end):
                return False
        return True

    async def _dispatch(self, request: Request) -> JSONResponse:
        path = "/" + request.path_params["path"].strip("/")
        params = dict(request.query_params)
        self.requests.append((path, params))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            with self._lock:
                return self._answer(path, params)
        except _BadDate as exc:
            return _error(400, str(exc))
        finally:
            self.in_flight -= 1

    def _answer(self, path: str, params: dict[str, str]) -> JSONResponse:
        clouds = self._clouds
        now = self.local_now()
        if path == "/hosts":
            return JSONResponse([h.as_dict(clouds) for h in self.hosts.values()])
        if path.startswith("/hosts/"):
            host = self.hosts.get(path.removeprefix("/hosts/"))
            if host is None:
                return _error(400, f"Host not found: {path.removeprefix('/hosts/')}")
            return JSONResponse(host.as_dict(clouds))
        if path == "/available":
            start = self._date(params, "start") or now
            end = self._date(params, "end") or now
            if start > end:
                end = start + timedelta(minutes=1)
            cloud = params.get("cloud")  # empty: any
            names = [
                h.name
                for h in self.hosts.values()
                if self._is_available(h, start, end) and (not cloud or h.cloud == cloud)
            ]
            return JSONResponse(names)
        if path.startswith("/available/"):
            name = path.removeprefix("/available/")
            given_start = self._date(params, "start")
            start = given_start + timedelta(minutes=1) if given_start else now
            end = self._date(params, "end") or now
            if start > end:
                end = start + timedelta(minutes=1)
            return JSONResponse({name: str(self._is_available(self.hosts.get(name), start, end))})
        if path in ("/schedules", "/schedules/current", "/schedules/future"):
            chosen = list(self.schedules)
            wanted = params.get("host")
            if wanted:
                host = self.hosts.get(wanted)
                if host is not None:
                    chosen = [s for s in chosen if s.host is host]
                elif path == "/schedules":
                    return _error(400, f"Host not found: {wanted}")
                # /current and /future look the host up and, finding none, filter by nothing: every host's.
            if path == "/schedules/current":
                date = self._date(params, "date") or now
                chosen = [s for s in chosen if s.start <= date <= s.end]
            elif path == "/schedules/future":
                chosen = [s for s in chosen if s.end >= now]  # QUADS' "future": not over yet
            return JSONResponse([s.as_dict(clouds) for s in chosen])
        return _error(404, f"The requested URL /api/v3{path} was not found on the server.")

    # -- running ----------------------------------------------------------------------------------------------

    def start(self) -> QuadsServer:
        app = Starlette(routes=[Route("/api/v3/{path:path}", self._dispatch, methods=["GET"])])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True, name="quads")
        self._thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the QUADS test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Take the server down: connections to its port are refused until `start()`."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self._server = None
        self._thread = None
        # The port is free again (nothing listens): a client's connection is refused.
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", self.port)) != 0

    def __enter__(self) -> QuadsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
