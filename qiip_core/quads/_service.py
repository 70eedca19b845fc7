"""QUADS for one daemon: the poller and the enforcer running, the node view's `quads` key, the entries of hosts
known only to QUADS, and the check a setup passes before any power or SSH work."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from qiip_core._errors import HostReserved, QuadsUnavailable
from qiip_core.config import QuadsSettings
from qiip_core.nodes import IPNetwork
from qiip_core.provisioning import Provisioner
from qiip_core.quads._client import QuadsClient
from qiip_core.quads._enforcer import QuadsEnforcer
from qiip_core.quads._models import Reservation, normalise_host
from qiip_core.quads._policy import conflict_at, next_reservation, overlaps, teardown_at
from qiip_core.quads._poller import Clock, QuadsPoller, utc_now
from qiip_core.routing import RoutingTable

__all__ = ["NOT_PROVISIONED", "QuadsService"]

NOT_PROVISIONED = "not_provisioned"
"""The status of a GPU host QUADS lends that is not (yet) a node."""


class QuadsService:
    """The QUADS integration of one daemon (`[quads]` must be enabled).

    Args:
        settings: `[quads]`.
        provisioner: the daemon's provisioner (teardowns, host logs).
        table: the routing table.
        client: the QUADS client; None: one for `settings`.
        clock: the time now.
        networks: `routing.allowed_endpoint_networks`, for the client's address rule.
    """

    def __init__(
        self,
        settings: QuadsSettings,
        provisioner: Provisioner,
        table: RoutingTable,
        *,
        client: QuadsClient | None = None,
        clock: Clock = utc_now,
        networks: Iterable[IPNetwork] = (),
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.client = client or QuadsClient.from_settings(settings, networks=networks)
        self.poller = QuadsPoller(
            self.client,
            lookahead_s=settings.lookahead_s,
            interval_s=settings.poll_interval_s,
            clock=clock,
            watched=lambda: [state.id for state in table],
        )
        self.enforcer = QuadsEnforcer(self.poller, provisioner, table, settings, clock=clock)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start polling and enforcing in the background."""
        self._tasks = [
            asyncio.get_running_loop().create_task(self.poller.run(), name="quads-poller"),
            asyncio.get_running_loop().create_task(self.enforcer.run(), name="quads-enforcer"),
        ]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.client.aclose()

    # -- setups --------------------------------------------------------------------------------------------

    def lends(self, host: str) -> bool:
        """True when QUADS knows `host` (its last good read): QUADS re-images such a host before lending it again."""
        snapshot = self.poller.snapshot
        return snapshot is not None and normalise_host(host) in snapshot.hosts

    async def check_setup(self, host: str) -> None:
        """Refuse a setup of `host` while QUADS marks it broken or retired, or reserves it within the lookahead
        (asked afresh, not from the poll).

        Raises:
            HostReserved: QUADS marks the host broken or retired, or a reservation is in force or starts within
                `quads.lookahead_s`.
            QuadsUnavailable: QUADS cannot be read, so whether the host is free is unknown.
        """
        host = normalise_host(host)
        now = self.clock()
        snapshot = self.poller.snapshot
        known = snapshot.hosts.get(host) if snapshot is not None else None
        try:
            fresh, reservations = await asyncio.gather(
                self.client.host(known.quads_name if known is not None and known.quads_name else host),
                self.client.reservations(host, now=now, quads_name=known.quads_name if known is not None else None),
            )
        except QuadsUnavailable as exc:
            raise QuadsUnavailable(
                f"QUADS cannot say whether {host} is free, so it is not set up: {exc.message} Retry when QUADS answers."
            ) from None
        mark = fresh.unusable_reason() if fresh is not None else None
        if mark is not None:
            raise HostReserved(
                f"Host {host} is marked {mark} in QUADS: it is not set up (a node on it would be torn down).",
                host=host,
            )
        end = now + timedelta(seconds=self.settings.lookahead_s)
        conflicts = [r for r in reservations if overlaps(r, now, end)]
        if conflicts:
            first = min(conflicts, key=lambda r: r.start)
            raise HostReserved(_reserved_message(host, first, now, self.settings.lookahead_s), host=host)

    # -- views ---------------------------------------------------------------------------------------------

    def host_view(self, host: str, now: datetime | None = None) -> dict[str, Any] | None:
        """The `quads` key of a node view: the host's GPUs, whether QUADS marks it broken or retired, its next
        reservation, when QUADS takes it back, when the enforcement tears a managed node on it down (`teardown_at`:
        the reservation's start less the lookahead, or now within it), how old the data is, and the enforcement's
        backoff; None for a host QUADS does not know."""
        snapshot = self.poller.snapshot
        host = normalise_host(host)
        if snapshot is None or host not in snapshot.hosts:
            return None
        now = now or self.clock()
        known = snapshot.hosts[host]
        reservations = snapshot.reservations.get(host, ())
        upcoming = next_reservation(reservations, now)
        lookahead_s = self.settings.lookahead_s
        within = conflict_at(host, snapshot, now, lookahead_s)
        conflict = within or (max(upcoming.start, now) if upcoming is not None else None)
        teardown = teardown_at(host, snapshot, now, lookahead_s)
        backoff = self.enforcer.backoffs.get(host)
        age = self.poller.age_s(now)
        return {
            "host": host,
            "gpus": known.gpus_view(),
            "model": known.model,
            "cloud": known.cloud,
            "broken": known.broken,
            "retired": known.retired,
            "available": within is None,
            "next_reservation": upcoming.view() if upcoming is not None else None,
            "next_conflict_at": conflict.isoformat() if conflict is not None else None,
            "seconds_to_conflict": round((conflict - now).total_seconds(), 3) if conflict is not None else None,
            "conflict_within_lookahead": within is not None,
            "teardown_at": teardown.isoformat() if teardown is not None else None,
            "lookahead_s": lookahead_s,
            "teardown": {
                "failures": backoff.failures,
                "next_attempt_at": backoff.next_attempt_at.isoformat() if backoff.next_attempt_at else None,
                "last_error": backoff.last_error,
            }
            if backoff is not None
            else None,
            "fetched_at": snapshot.fetched_at.isoformat(),
            "data_age_s": round(age, 3) if age is not None else None,
            "stale": self.poller.stale(now),
            "last_error": self.poller.last_error,
        }

    def unprovisioned(self, registered: Iterable[str], now: datetime | None = None) -> list[dict[str, Any]]:
        """Entries of `GET /admin/nodes` for the GPU hosts QUADS lends that are not registered nodes: the node
        view's keys, with no engine, endpoint, model or artifact, and the status `not_provisioned`."""
        snapshot = self.poller.snapshot
        if snapshot is None:
            return []
        now = now or self.clock()
        taken = {normalise_host(n) for n in registered}
        entries: list[dict[str, Any]] = []
        for host in sorted(snapshot.hosts):
            if host in taken or not snapshot.hosts[host].lendable:
                continue
            entries.append(
                {
                    "id": host,
                    "endpoint": None,
                    "status": NOT_PROVISIONED,
                    "model": None,
                    "engine": None,
                    "artifact_id": None,
                    "llamacpp_runtime": None,
                    "capabilities": None,
                    "managed": False,
                    "last_heartbeat": None,
                    "source": "quads",
                    "in_flight": 0,
                    "breaker": None,
                    "last_error": None,
                    "last_error_at": None,
                    "recent_errors": [],
                    "slots": None,
                    "health": None,
                    "quads": self.host_view(host, now),
                }
            )
        return entries


def _reserved_message(host: str, reservation: Reservation, now: datetime, lookahead_s: float) -> str:
    start = reservation.start.strftime("%Y-%m-%d %H:%M UTC")
    hours = lookahead_s / 3600
    window = f"{hours:g} h" if hours >= 1 else f"{lookahead_s:g} s"
    when = f"since {start} (in force now)" if reservation.start <= now else f"from {start}"
    return (
        f"Host {host} is reserved in QUADS {when} for {reservation.describe()}, within the lookahead of {window} "
        "(quads.lookahead_s): it is not set up."
    )
