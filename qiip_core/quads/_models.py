"""QUADS' JSON, as QIIP reads it, and what QIIP keeps of it.

QUADS (`/api/v3`) writes datetimes in RFC 1123 (`Tue, 02 Jul 2024 22:00:00 GMT`). The server stores naive
datetimes in its own local time and its JSON encoder labels every naive datetime GMT, so the label is not to be
believed: the wall-clock time is the server's local time, in `quads.timezone`. The wire models keep it naive;
`to_utc` gives it its zone.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Annotated, Any
from zoneinfo import ZoneInfo

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

__all__ = [
    "QuadsHost",
    "Reservation",
    "WireAssignment",
    "WireHost",
    "WireProcessor",
    "WireSchedule",
    "normalise_host",
    "parse_rfc1123",
    "server_time",
    "to_utc",
]

QUERY_FORMAT = "%Y-%m-%dT%H:%M"
"""How QUADS takes datetimes in a query: naive, to the minute, in the server's local time."""


def normalise_host(name: str) -> str:
    """A host name as QIIP compares them: stripped, lower case, without a trailing dot."""
    return name.strip().lower().rstrip(".")


def parse_rfc1123(value: Any) -> Any:
    """An RFC 1123 date (`Tue, 02 Jul 2024 22:00:00 GMT`) as a naive datetime of its wall-clock time; other values
    pass through for pydantic to judge (an ISO 8601 string is accepted as well)."""
    if isinstance(value, str) and "," in value:
        try:
            parsed = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return value
        return parsed.replace(tzinfo=None)
    if isinstance(value, datetime):
        return value.replace(tzinfo=None)
    return value


NaiveServerTime = Annotated[datetime, BeforeValidator(parse_rfc1123)]


def server_time(moment: datetime, tz: ZoneInfo) -> str:
    """`moment` (aware) as QUADS takes it in a query: naive `YYYY-MM-DDTHH:MM` in the server's zone.

    Raises:
        ValueError: `moment` is naive.
    """
    if moment.tzinfo is None:
        raise ValueError("a naive datetime has no zone to convert from")
    return moment.astimezone(tz).strftime(QUERY_FORMAT)


def to_utc(naive: datetime, tz: ZoneInfo) -> datetime:
    """A naive wall-clock time of the QUADS server as an aware UTC datetime (an hour that happens twice, when
    clocks go back, is read as its first occurrence)."""
    return naive.replace(tzinfo=tz, fold=0).astimezone(UTC)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class WireProcessor(_Wire):
    """One processor of a host: `{id, handle, vendor, product, cores, threads, processor_type}`."""

    vendor: str | None = None
    product: str | None = None
    processor_type: str | None = None


class WireCloud(_Wire):
    """`{id, name, last_redefined}`."""

    name: str


def _cloud(value: Any) -> Any:
    """A cloud given by its name alone is the same cloud."""
    return {"name": value} if isinstance(value, str) else value


Cloud = Annotated[WireCloud | None, BeforeValidator(_cloud)]


class WireHost(_Wire):
    """A host of `GET /hosts` (only the fields QIIP reads)."""

    name: str = Field(min_length=1)
    model: str | None = None
    broken: bool = False
    retired: bool = False
    cloud: Cloud = None
    processors: list[WireProcessor] = Field(default_factory=list)


class WireAssignment(_Wire):
    """A schedule's assignment: who has the host (`description`, `owner`, `ticket`, its cloud)."""

    id: int | None = None
    description: str | None = None
    owner: str | None = None
    ticket: str | None = None
    cloud: Cloud = None


class WireHostRef(_Wire):
    name: str


class WireSchedule(_Wire):
    """A schedule of `GET /schedules/current` or `/schedules/future`: one host, one assignment, a time span."""

    id: int
    start: NaiveServerTime
    end: NaiveServerTime
    assignment_id: int | None = None
    assignment: WireAssignment | None = None
    host: WireHostRef | None = None


@dataclass(frozen=True)
class QuadsHost:
    """A host QUADS knows: a GPU host QIIP may use while QUADS lends it, or any host a node stands on (QUADS' word
    on it is enforced whether or not it lists GPUs)."""

    name: str
    """The host's name, normalised (`normalise_host`)."""
    gpu_vendor: str | None
    """The first GPU's vendor."""
    gpu_product: str | None
    """The first GPU's product."""
    gpu_count: int
    """How many GPU processors QUADS lists."""
    model: str | None = None
    """The host's hardware model, when QUADS knows it."""
    cloud: str | None = None
    """The cloud the host sits in now (QUADS' spare pool or a tenant's)."""
    quads_name: str = ""
    """The name as QUADS spells it, for QUADS' own lookups (`?host=`); empty: `name`."""
    broken: bool = False
    """QUADS marks the host broken: nothing may be set up on it, and a node on it is torn down."""
    retired: bool = False
    """QUADS marks the host retired: as broken."""

    @property
    def usable(self) -> bool:
        """Neither broken nor retired."""
        return not (self.broken or self.retired)

    @property
    def lendable(self) -> bool:
        """A GPU host QIIP may set up while QUADS lends it: usable, with at least one GPU processor listed."""
        return self.usable and self.gpu_count > 0

    def unusable_reason(self) -> str | None:
        """`broken`, `retired` (or both), or None for a usable host."""
        marks = [word for word, on in (("broken", self.broken), ("retired", self.retired)) if on]
        return " and ".join(marks) or None

    @classmethod
    def from_wire(cls, host: WireHost) -> QuadsHost:
        """The host as QIIP keeps it."""
        gpus = [p for p in host.processors if (p.processor_type or "").upper() == "GPU"]
        return cls(
            name=normalise_host(host.name),
            gpu_vendor=gpus[0].vendor if gpus else None,
            gpu_product=gpus[0].product if gpus else None,
            gpu_count=len(gpus),
            model=host.model,
            cloud=host.cloud.name if host.cloud else None,
            quads_name=host.name,
            broken=host.broken,
            retired=host.retired,
        )

    def gpus_view(self) -> dict[str, Any]:
        return {"vendor": self.gpu_vendor, "product": self.gpu_product, "count": self.gpu_count}


@dataclass(frozen=True)
class Reservation:
    """One QUADS schedule of a host, in UTC."""

    id: int
    host: str
    start: datetime
    end: datetime
    assignment_id: int | None = None
    description: str | None = None
    cloud: str | None = None
    owner: str | None = None
    ticket: str | None = None

    @classmethod
    def from_wire(cls, schedule: WireSchedule, host: str, tz: ZoneInfo) -> Reservation:
        assignment = schedule.assignment
        return cls(
            id=schedule.id,
            host=host,
            start=to_utc(schedule.start, tz),
            end=to_utc(schedule.end, tz),
            assignment_id=assignment.id if assignment and assignment.id is not None else schedule.assignment_id,
            description=assignment.description if assignment else None,
            cloud=assignment.cloud.name if assignment and assignment.cloud else None,
            owner=assignment.owner if assignment else None,
            ticket=assignment.ticket if assignment else None,
        )

    def view(self) -> dict[str, Any]:
        return {
            "start": self.start.isoformat(),
            "end": self.end.isoformat(),
            "assignment": self.description,
            "assignment_id": self.assignment_id,
            "cloud": self.cloud,
            "owner": self.owner,
            "ticket": self.ticket,
        }

    def describe(self) -> str:
        """`cloud02 (owner alice, ticket 1234)`: who has the host, for messages."""
        who = [f"owner {self.owner}"] if self.owner else []
        if self.ticket:
            who.append(f"ticket {self.ticket}")
        name = self.cloud or self.description or f"assignment {self.assignment_id}"
        return name + (f" ({', '.join(who)})" if who else "")
