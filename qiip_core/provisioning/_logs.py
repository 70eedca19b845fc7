"""Provisioning logs: what every setup and teardown printed, per host, bounded, and followed live.

One `HostLogs` holds the recent entries of each host, `{ts, level, msg, stream, step}`, bounded per host by entry
count and bytes (the oldest entries go first) and across hosts by host count (the host written to longest ago goes
first). A follower (the admin API's SSE route) gets the entries kept, then every new one, from an `asyncio.Queue`;
a follower that stops reading loses entries rather than holding memory (it sees a `gap` entry).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

__all__ = ["HostLogs", "LogEntry", "LogStream"]

LogStream = Literal["stdout", "stderr", "gateway"]
"""Where a line came from: the remote command's stdout or stderr, or the gateway itself."""

_FOLLOWER_QUEUE = 1024
"""Entries a follower may lag behind before it loses some."""


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One line of a host's provisioning log."""

    ts: datetime
    """When the gateway received it (UTC)."""
    level: str
    """`info`, `warning` or `error`."""
    msg: str
    """The line."""
    stream: LogStream
    """stdout, stderr or gateway."""
    step: str | None
    """The task step it belongs to."""

    def view(self) -> dict[str, Any]:
        """The entry as JSON: `{ts, level, msg, stream, step}`."""
        return {
            "ts": self.ts.isoformat(),
            "level": self.level,
            "msg": self.msg,
            "stream": self.stream,
            "step": self.step,
        }

    @property
    def size_bytes(self) -> int:
        """What the entry counts against `max_bytes`: its message and a fixed overhead."""
        return len(self.msg.encode()) + 64


@dataclass(slots=True)
class _HostLog:
    entries: collections.deque[LogEntry] = field(default_factory=collections.deque)
    size_bytes: int = 0
    followers: set[asyncio.Queue[LogEntry | None]] = field(default_factory=set)


class HostLogs:
    """Bounded provisioning logs of many hosts.

    Args:
        max_entries: entries kept per host.
        max_bytes: bytes kept per host (`LogEntry.size_bytes`).
        max_hosts: hosts kept; the least recently written is evicted first.
    """

    def __init__(self, *, max_entries: int = 5000, max_bytes: int = 2 * 1024 * 1024, max_hosts: int = 256) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_hosts = max_hosts
        self._hosts: collections.OrderedDict[str, _HostLog] = collections.OrderedDict()

    def append(
        self, host: str, msg: str, *, level: str = "info", stream: LogStream = "gateway", step: str | None = None
    ) -> LogEntry:
        """Add a line to `host`'s log and hand it to its followers.

        Returns:
            The entry.
        """
        entry = LogEntry(ts=datetime.now(UTC), level=level, msg=msg, stream=stream, step=step)
        log = self._hosts.get(host)
        if log is None:
            log = self._hosts[host] = _HostLog()
        self._hosts.move_to_end(host)
        log.entries.append(entry)
        log.size_bytes += entry.size_bytes
        while log.entries and (len(log.entries) > self.max_entries or log.size_bytes > self.max_bytes):
            log.size_bytes -= log.entries.popleft().size_bytes
        for queue in log.followers:
            if queue.full():
                queue.get_nowait()
                queue.put_nowait(LogEntry(entry.ts, "warning", "log entries were dropped here", "gateway", None))
            queue.put_nowait(entry)
        while len(self._hosts) > self.max_hosts:
            oldest, evicted = next(iter(self._hosts.items()))
            if evicted.followers:
                # A host someone follows stays; the next one is evicted instead (or none, if all are followed).
                self._hosts.move_to_end(oldest)
                if all(h.followers for h in self._hosts.values()):
                    break
                continue
            del self._hosts[oldest]
        return entry

    def entries(self, host: str) -> list[LogEntry]:
        """The entries kept for `host`, oldest first (empty for an unknown host)."""
        log = self._hosts.get(host)
        return list(log.entries) if log is not None else []

    def hosts(self) -> list[str]:
        """Hosts with a log, least recently written first."""
        return list(self._hosts)

    @contextlib.contextmanager
    def follow(self, host: str) -> Iterator[tuple[list[LogEntry], asyncio.Queue[LogEntry | None]]]:
        """Follow `host`'s log: the entries kept now, and a queue of every later one.

        Yields:
            `(backlog, queue)`; the queue receives each new entry, and None when the log is closed (`close`).
        """
        log = self._hosts.get(host)
        if log is None:
            log = self._hosts[host] = _HostLog()
        queue: asyncio.Queue[LogEntry | None] = asyncio.Queue(maxsize=_FOLLOWER_QUEUE)
        log.followers.add(queue)
        try:
            yield list(log.entries), queue
        finally:
            log.followers.discard(queue)
            if not log.entries and not log.followers and self._hosts.get(host) is log:
                del self._hosts[host]  # nothing was written while followed: keep nothing for it

    def close(self) -> None:
        """End every follower (the daemon is shutting down)."""
        for log in self._hosts.values():
            for queue in log.followers:
                if queue.full():
                    queue.get_nowait()
                queue.put_nowait(None)
