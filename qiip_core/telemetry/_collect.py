"""The daemon's side of live GPU telemetry: the latest reading of each node, and where readings come from.

```
TelemetryStore                 node id → latest reading, aged by the daemon's own clock
├── EtcdTelemetryWatch         follows <etcd.telemetry_prefix> (registry.backend = "etcd")
└── AgentPoller                polls each [[telemetry.agents]] endpoint every interval (embedded registry)
```

A reading is aged from when the daemon received it (not from the agent's `read_at`, which is another host's
clock): a poll that returns the reading already held does not make it younger. A reading is stale once it is older
than `telemetry.expire_after_intervals` of its own intervals (the `interval_s` the agent reports in it, or the
daemon's poll interval when that is longer): an agent reading every 10 s is judged by 10 s, whatever the daemon's
`telemetry.interval_s`. The admin API still shows a stale reading (with its age); Prometheus no longer gets it.
With etcd, the key's lease removes a dead agent's reading by itself.

Readings arrive as JSON from other hosts; each is validated as a `NodeTelemetry` and bounded in size before it is
kept, and a reading whose `node_id` is not the one it was published under is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import ValidationError

from qiip_core._errors import ConfigError
from qiip_core._violation import first_violation
from qiip_core.config import Settings, TelemetryAgentConfig
from qiip_core.discovery import read_token_file
from qiip_core.storage import EtcdClient, PrefixFollower, load_json_object, unb64
from qiip_core.telemetry._types import TELEMETRY_PATH, LiveGpus, NodeTelemetry

__all__ = [
    "MAX_INTERVAL_S",
    "MAX_READING_BYTES",
    "AgentPoller",
    "EtcdTelemetryWatch",
    "LiveReading",
    "TelemetrySource",
    "TelemetryStore",
    "create_telemetry_source",
    "decode_reading",
]

logger = logging.getLogger("qiip.telemetry")

MAX_READING_BYTES = 256 * 1024
"""The largest reading accepted: 64 GPUs with 256 processes each fit in well under this."""

MAX_INTERVAL_S = 3600.0
"""The longest interval a reading is judged by: the longest an agent may be set to read at (`telemetry.interval_s`),
so a reading that claims more still goes stale."""


def decode_reading(value: bytes, node_id: str) -> NodeTelemetry:
    """Parse a published reading of `node_id`.

    Raises:
        ValueError: too large, not a JSON object, not a reading, or the reading of another node.
    """
    data = load_json_object(value, max_value_bytes=MAX_READING_BYTES)
    try:
        reading = NodeTelemetry.model_validate(data)
    except ValidationError as exc:
        error = first_violation(exc)
        raise ValueError(f"{error.field}: {error.message}") from None
    if reading.node_id != node_id:
        raise ValueError(f"the reading is of node {reading.node_id!r}, published as {node_id!r}")
    return reading


@dataclass(slots=True, frozen=True)
class LiveReading:
    """A node's latest reading and when this daemon received it."""

    reading: NodeTelemetry
    received_at: float
    """`time.monotonic()` when the daemon received it."""
    expiry_s: float
    """Its age in seconds past which it is stale (`TelemetryStore.expiry_for`)."""


class TelemetryStore:
    """The latest reading of each node.

    Args:
        expire_after_intervals: how many of a reading's intervals it stays fresh
            (`telemetry.expire_after_intervals`).
        min_interval_s: the shortest interval a reading is judged by, in seconds: the daemon's poll interval when it
            polls agents (a reading cannot be renewed faster than it is fetched); 0 when readings are pushed (etcd).
        clock: the monotonic clock, in seconds.
    """

    def __init__(
        self,
        *,
        expire_after_intervals: int,
        min_interval_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.expire_after_intervals = expire_after_intervals
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._latest: dict[str, LiveReading] = {}

    def expiry_for(self, reading: NodeTelemetry) -> float:
        """Seconds after its receipt that `reading` goes stale: `expire_after_intervals` of its own interval (the
        agent's `interval_s`, at most `MAX_INTERVAL_S`), or of `min_interval_s` when that is longer."""
        return self.expire_after_intervals * max(min(reading.interval_s, MAX_INTERVAL_S), self.min_interval_s)

    def __len__(self) -> int:
        return len(self._latest)

    def put(self, reading: NodeTelemetry) -> bool:
        """Keep `reading` as its node's latest. Returns False when it is the one already held (not aged anew)."""
        held = self._latest.get(reading.node_id)
        if held is not None and held.reading.read_at == reading.read_at:
            return False
        self._latest[reading.node_id] = LiveReading(reading, self._clock(), self.expiry_for(reading))
        return True

    def delete(self, node_id: str) -> None:
        """Forget a node's reading (its agent's key expired or was deleted)."""
        self._latest.pop(node_id, None)

    def get(self, node_id: str) -> LiveReading | None:
        """The node's latest reading, stale or not; None when there is none."""
        return self._latest.get(node_id)

    def age_s(self, live: LiveReading) -> float:
        """Seconds since the daemon received `live`."""
        return max(0.0, self._clock() - live.received_at)

    def fresh_with_age(self) -> Iterator[tuple[str, NodeTelemetry, float]]:
        """(node id, reading, age in seconds) of every reading that is not stale (`expiry_for`), by node id."""
        now = self._clock()
        for node_id in sorted(self._latest):
            live = self._latest[node_id]
            age_s = max(0.0, now - live.received_at)
            if age_s <= live.expiry_s:
                yield node_id, live.reading, age_s

    def view(self, node_id: str) -> dict[str, Any] | None:
        """A node's live GPUs as the admin API shows them (`gpus_live`), or None without a reading.

        Returns:
            A `LiveGpus` as JSON: `{"read_at": ISO 8601 (the agent's clock), "age_s": seconds since received,
            "stale": bool, "interval_s", "driver_version", "gpus": [{index, name, uuid, memory_used_mib,
            memory_total_mib, utilization_percent, temperature_c, power_w, processes: [{pid, name,
            used_memory_mib}], process_count}]}`.
        """
        live = self._latest.get(node_id)
        if live is None:
            return None
        age_s = self.age_s(live)
        reading = live.reading
        view = LiveGpus(
            read_at=reading.read_at,
            age_s=round(age_s, 3),
            stale=age_s > live.expiry_s,
            interval_s=reading.interval_s,
            driver_version=reading.driver_version,
            gpus=reading.gpus,
        )
        return view.model_dump(mode="json")


class TelemetrySource:
    """Feeds a `TelemetryStore`; this base feeds nothing (no agent configured)."""

    async def start(self) -> None:
        """Start receiving readings in the background. Never raises for an unreachable source."""

    async def aclose(self) -> None:
        """Stop receiving readings."""


class EtcdTelemetryWatch(TelemetrySource):
    """Follows `<etcd.telemetry_prefix>`: each key is one node's reading, removed when its agent's lease ends.

    Args:
        settings: the daemon's settings (`[etcd]`).
        store: where readings go.
    """

    def __init__(self, settings: Settings, store: TelemetryStore) -> None:
        self.store = store
        self.client = EtcdClient(settings.etcd)
        self._follower = PrefixFollower(
            self.client,
            settings.etcd.telemetry_prefix.encode(),
            on_put=self._apply_put,
            on_delete=store.delete,
            label="telemetry",
            watched="GPU readings",
            outage="Keeping the last GPU readings until they go stale",
            task_name="qiip-telemetry-follow",
            log=logger,
        )

    def _apply_put(self, node_id: str, kv: dict[str, Any], mod_revision: int) -> None:
        try:
            reading = decode_reading(unb64(kv.get("value", "")), node_id)
        except ValueError as exc:
            logger.warning("telemetry: skipping the reading of %s at revision %d: %s", node_id, mod_revision, exc)
            return
        self.store.put(reading)

    async def start(self) -> None:
        await self._follower.start()

    async def aclose(self) -> None:
        await self._follower.aclose()
        self.client.close()


@dataclass(slots=True)
class _Agent:
    node: str
    url: str
    token: str
    problem: str | None = None


class AgentPoller(TelemetrySource):
    """Polls each configured agent's `GET /v1/telemetry` every interval (the embedded registry).

    Args:
        settings: the daemon's settings (`[telemetry]`).
        store: where readings go.

    Raises:
        ConfigError: an agent has no token (`telemetry.token_file`, `telemetry.token` or its own `token_file`), or
            a token file is not a private regular file.
    """

    def __init__(self, settings: Settings, store: TelemetryStore) -> None:
        self.settings = settings.telemetry
        self.store = store
        self.agents = [self._agent(i, agent) for i, agent in enumerate(self.settings.agents)]
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None

    def _agent(self, i: int, agent: TelemetryAgentConfig) -> _Agent:
        if agent.token_file is not None:
            token = read_token_file(agent.token_file, setting=f"telemetry.agents[{i}].token_file", what="token file")
        elif self.settings.token_file is not None:
            token = read_token_file(self.settings.token_file, setting="telemetry.token_file", what="token file")
        elif self.settings.token is not None:
            token = self.settings.token.get_secret_value()
        else:
            raise ConfigError(
                f"telemetry.agents[{i}] (node {agent.node}) has no bearer token: set telemetry.token_file, or the "
                "agent's own token_file."
            )
        return _Agent(agent.node, agent.url + TELEMETRY_PATH, token)

    async def _poll(self, agent: _Agent) -> None:
        assert self._client is not None
        try:
            response = await self._client.get(agent.url, headers={"Authorization": f"Bearer {agent.token}"})
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}: {response.text[:200]}")
            reading = decode_reading(response.content, agent.node)
        except (httpx.HTTPError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}" if isinstance(exc, httpx.HTTPError) else str(exc)
            if problem != agent.problem:
                logger.warning("telemetry: no reading from the agent of %s at %s: %s", agent.node, agent.url, problem)
            agent.problem = problem
            return
        if agent.problem is not None:
            logger.info("telemetry: the agent of %s answers again", agent.node)
            agent.problem = None
        self.store.put(reading)

    async def _run(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(agent) for agent in self.agents))
            await asyncio.sleep(self.settings.interval_s)

    async def start(self) -> None:
        if not self.agents:
            return
        timeout = self.settings.poll_timeout_s
        self._client = httpx.AsyncClient(timeout=timeout, trust_env=False, follow_redirects=False)
        self._task = asyncio.create_task(self._run(), name="qiip-telemetry-poll")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def create_telemetry_source(settings: Settings, store: TelemetryStore) -> TelemetrySource:
    """Where the daemon gets readings: etcd with the etcd registry, else the configured agents' endpoints.

    Raises:
        ConfigError: an agent's token cannot be read (see `AgentPoller`).
    """
    if settings.registry.backend == "etcd":
        return EtcdTelemetryWatch(settings, store)
    return AgentPoller(settings, store)
