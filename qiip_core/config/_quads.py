"""The settings of the QUADS scheduler integration (`[quads]`).

Many GPU hosts are lent by QUADS: QIIP may use one only while QUADS says it is free. With `url` and `timezone`
both set, the daemon polls QUADS for its GPU hosts and their reservations, shows them in `GET /admin/nodes`,
refuses setups of hosts reserved within the lookahead, and tears managed nodes down before a reservation starts.
"""

from __future__ import annotations

from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import httpx
from pydantic import Field, field_validator, model_validator

from qiip_core.config._groups import PositiveSeconds, _Group

__all__ = ["QuadsSettings"]


class QuadsSettings(_Group):
    """The QUADS scheduler (`[quads]`): where its API answers, its timezone, and how often it is read.

    Both `url` and `timezone` are needed to enable it; neither disables it; one without the other is an error.
    """

    url: str | None = None
    """The QUADS server's base URL (`https://quads.example`); the API is read under `/api/v3`. Reads need no
    credentials. None: QUADS is not used."""
    timezone: str | None = None
    """The IANA timezone the QUADS server runs in (`America/New_York`): QUADS takes and returns naive local
    times, so QIIP converts its own (UTC) times to this zone and back."""
    poll_interval_s: PositiveSeconds = 300.0
    """Seconds between polls of QUADS' hosts, availability and schedules."""
    lookahead_s: float = Field(default=86_400.0, gt=0, le=30 * 86_400)
    """How far ahead a reservation counts: a host reserved within it is not set up, and a managed node on it is
    torn down (default 24 h)."""
    replica_teardown_before_s: float = Field(default=900.0, gt=0, le=30 * 86_400)
    """For a deployment's replica, how long before the reservation starts the enforcement tears it down if it is
    still there (15 min): from the lookahead on, its deployment replaces it elsewhere first (make-before-break), and
    this is the backstop. Other managed nodes are torn down as soon as the reservation is within the lookahead."""
    enforce_interval_s: PositiveSeconds = 300.0
    """Seconds between checks of the managed nodes against the schedule."""
    backoff_initial_s: PositiveSeconds = 60.0
    """The wait before retrying a teardown that failed, doubled at each further failure."""
    backoff_cap_s: PositiveSeconds = 3600.0
    """The longest wait between teardown retries."""
    timeout_s: PositiveSeconds = 10.0
    """Deadline of one whole QUADS request (connect, send, read the answer), in seconds."""
    max_answer_bytes: int = Field(default=16 * 1024 * 1024, ge=64 * 1024, le=1024 * 1024 * 1024)
    """The largest QUADS answer read, in bytes; a larger one fails the poll (16 MiB)."""
    max_concurrent_requests: int = Field(default=8, ge=1, le=256)
    """QUADS requests in flight at once (a poll asks for each host's schedules)."""

    @property
    def enabled(self) -> bool:
        """True when QUADS is configured (`url` and `timezone`)."""
        return self.url is not None and self.timezone is not None

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        value = value.strip().rstrip("/")
        try:
            url = httpx.URL(value)
        except httpx.InvalidURL as exc:  # not a ValueError: pydantic would let it through as a crash
            raise ValueError(f"{value!r} is not a URL: {exc}") from None
        if url.scheme not in ("http", "https") or not url.host or url.userinfo or url.query:
            raise ValueError(f"{value!r} is not an http(s):// base URL without credentials or query")
        return value

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        value = value.strip()
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"{value!r} is not an IANA timezone such as America/New_York or UTC") from None
        return value

    @model_validator(mode="after")
    def _both(self) -> QuadsSettings:
        if (self.url is None) != (self.timezone is None):
            raise ValueError(
                "quads.url and quads.timezone go together: QUADS speaks in its server's local time, so give the "
                "IANA timezone it runs in with its URL (or neither, to not use QUADS)"
            )
        if self.backoff_initial_s > self.backoff_cap_s:
            raise ValueError("quads.backoff_initial_s must not exceed quads.backoff_cap_s")
        return self
