"""Background health checks.

Every `interval_s` each node gets `GET /health` (an attached server `GET /v1/models`; an Ollama server its native
`GET /api/version` and `GET /api/tags`, then `GET /api/ps` for what it holds in memory: `_ollama`), and a node
whose probe failed gets the next one after `retry_interval_s`. The answer is classified (`classify_health`) and
applied to the routing table (`apply_probe`), both pure so the transition matrix is tested without a network:

| probe       | breaker | effect                                                                    |
|-------------|---------|---------------------------------------------------------------------------|
| ok          | closed  | failures reset; unknown/unhealthy → healthy                               |
| ok          | open    | as above, and the breaker's trial at once: a one-token completion         |
| loading     | any     | llama-server's 503 "Loading model": not ready, never a failure → unknown  |
| failed      | any     | failures + 1; at `failure_threshold`, healthy/unknown → unhealthy         |

Lifecycle statuses (draining, provisioning, …) are never changed here; liveness is still recorded so the
node is ready the moment its lifecycle ends. Nodes being provisioned are not probed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime

import aiohttp

from qiip_core._errors import safe_text
from qiip_core.config import HealthSettings
from qiip_core.health._ollama import probe_ollama, read_resident
from qiip_core.health._probe import ProbeOutcome, health_session, probe_health
from qiip_core.nodes import EndpointPolicy, Engine, NodeStatus
from qiip_core.routing import BreakerState, ChangeKind, NodeState, RoutingTable, TableChange
from qiip_core.upstream import describe_client_error, is_local_exhaustion

__all__ = ["HealthChecker", "apply_probe"]

logger = logging.getLogger("qiip.health")


def apply_probe(
    table: RoutingTable, state: NodeState, outcome: ProbeOutcome, *, error: str | None, failure_threshold: int
) -> bool:
    """Apply one probe's outcome to a node.

    Args:
        table: the routing table holding `state`.
        state: the probed node.
        outcome: the classified answer.
        error: what went wrong, for `FAILED`.
        failure_threshold: consecutive failures that make the node unhealthy.

    Returns:
        True when the node answers but its circuit breaker is open: the caller should run the recovery probe.
    """
    state.last_probe_at = datetime.now(UTC)
    node_id = state.id
    if outcome is ProbeOutcome.OK:
        state.health_failures = 0
        table.mark_heartbeat(node_id)
        table.set_liveness(node_id, NodeStatus.HEALTHY, reason="health probe ok")
        return state.breaker.state is BreakerState.OPEN
    if outcome is ProbeOutcome.LOADING:
        table.set_liveness(node_id, NodeStatus.UNKNOWN, reason="loading its model")
        return False
    state.health_failures += 1
    state.note_error(error)
    # The last slot (or loaded-model) reading is from a server that no longer answers.
    state.slots = None
    state.resident = None
    if state.health_failures >= failure_threshold and state.liveness is not NodeStatus.UNHEALTHY:
        table.set_liveness(
            node_id,
            NodeStatus.UNHEALTHY,
            reason=f"{state.health_failures} failed health probe{'s' if state.health_failures != 1 else ''}: {error}",
        )
    elif state.health_failures < failure_threshold:
        # Still counts as an observation, so the registry's liveness no longer applies.
        state.observed = True
    return False


class HealthChecker:
    """Probes every node on an interval and each new node at once.

    Args:
        table: the routing table to observe and update.
        settings: interval, timeouts, threshold, concurrency.
        session: the aiohttp session for probes (a dedicated one by default, with its own small pool so
            probes never wait behind client traffic; closed by `aclose()`).
        on_healthy: awaited after each successful probe of a healthy node (etcd lease refresh).
        headers_for: extra request headers for a node (an attached server's bearer token).
        policy: the endpoint allowlist the addresses of host names are checked against when connecting.
    """

    def __init__(
        self,
        table: RoutingTable,
        settings: HealthSettings,
        *,
        session: aiohttp.ClientSession | None = None,
        on_healthy: Callable[[NodeState], Awaitable[None]] | None = None,
        headers_for: Callable[[str], Mapping[str, str]] | None = None,
        policy: EndpointPolicy | None = None,
    ) -> None:
        self.table = table
        self.policy = policy
        self.settings = settings
        self._owns_session = session is None
        self._session = session
        self._on_healthy = on_healthy
        self._headers_for = headers_for or (lambda node_id: {})
        self._semaphore = asyncio.Semaphore(settings.concurrency)
        self._probing: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._retries: set[asyncio.TimerHandle] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._unsubscribe: Callable[[], None] | None = None

    def start(self) -> None:
        """Start the probe loop and probe nodes as soon as they are added."""
        self._unsubscribe = self.table.add_listener(self._on_change)
        self._loop_task = asyncio.create_task(self._run(), name="qiip-health")

    async def aclose(self) -> None:
        """Stop probing and close the client."""
        if self._unsubscribe is not None:
            self._unsubscribe()
        for handle in self._retries:
            handle.cancel()
        tasks = [t for t in (self._loop_task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._owns_session and self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The probe session, created on first use inside the event loop."""
        if self._session is None:
            self._session = health_session(
                policy=self.policy, timeout_s=self.settings.timeout_s, limit=self.settings.concurrency, force_close=True
            )
        return self._session

    def _on_change(self, change: TableChange) -> None:
        if change.kind is ChangeKind.ADDED:
            self.probe_soon(change.node.id)

    def probe_soon(self, node_id: str) -> None:
        """Probe one node now, in the background (no-op while a probe of it is running)."""
        if node_id in self._probing:
            return
        task = asyncio.create_task(self.probe(node_id), name=f"qiip-health-{node_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _retry_soon(self, node_id: str) -> None:
        handle = asyncio.get_running_loop().call_later(self.settings.retry_interval_s, self.probe_soon, node_id)
        self._retries.add(handle)
        # Forget it once it ran (TimerHandle has no done callback: drop the ones whose time has passed).
        now = asyncio.get_running_loop().time()
        self._retries = {h for h in self._retries if h.when() > now and not h.cancelled()}

    async def _run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.settings.interval_s)

    async def probe_all(self) -> None:
        """Probe every node once, at most `concurrency` at a time."""
        await asyncio.gather(*(self.probe(state.id) for state in self.table), return_exceptions=False)

    async def probe(self, node_id: str) -> None:
        """Probe one node and apply the outcome (and the recovery probe when its breaker is open)."""
        state = self.table.get(node_id)
        if state is None or node_id in self._probing or state.status is NodeStatus.PROVISIONING:
            return
        self._probing.add(node_id)
        try:
            async with self._semaphore:
                outcome, error = await self._health(state)
                if self.table.get(node_id) is not state:
                    return
                if outcome is ProbeOutcome.LOCAL_FAILURE:
                    # The gateway is out of file descriptors: says nothing about the node.
                    logger.warning("probe of node %s not run: %s", node_id, error)
                    return
                needs_recovery = apply_probe(
                    self.table, state, outcome, error=error, failure_threshold=self.settings.failure_threshold
                )
                if outcome is ProbeOutcome.FAILED and state.health_failures < self.settings.failure_threshold:
                    # Look again soon: a node that hangs must not keep getting requests for whole intervals.
                    self._retry_soon(node_id)
                if outcome is ProbeOutcome.OK and state.node.engine is Engine.LLAMA_CPP:
                    state.slots = await self._slots(state)
                if outcome is ProbeOutcome.OK and state.node.engine is Engine.OLLAMA:
                    state.resident = await read_resident(state.node.endpoint, state.node.model, session=self.session)
                if needs_recovery:
                    await self._recover(state)
                if outcome is ProbeOutcome.OK and state.status is NodeStatus.HEALTHY and self._on_healthy is not None:
                    await self._on_healthy(state)
        except Exception:
            logger.exception("probing node %s failed unexpectedly", node_id)
        finally:
            self._probing.discard(node_id)

    async def _health(self, state: NodeState) -> tuple[ProbeOutcome, str | None]:
        if state.node.engine is Engine.ATTACHED:
            return await self._models_listed(state)
        if state.node.engine is Engine.OLLAMA:
            ollama = await probe_ollama(state.node.endpoint, state.node.model, session=self.session)
            return ollama.outcome, None if ollama.error is None else safe_text(ollama.error)
        answer = await probe_health(state.node.endpoint, session=self.session)
        if answer.error is not None:
            return answer.outcome, _describe("GET /health", answer.error)
        return (
            answer.outcome,
            None if answer.outcome is not ProbeOutcome.FAILED else f"GET /health answered {answer.status}",
        )

    async def _slots(self, state: NodeState) -> tuple[int, int] | None:
        """llama-server's slots, busy and total (`GET /slots`, on by default; `--no-slots` answers 501): a
        slot is busy while `is_processing`. None when the node does not answer with a slot list; that says
        nothing of its health."""
        try:
            async with self.session.get(state.node.endpoint + "/slots", allow_redirects=False) as response:
                if response.status != 200:
                    return None
                slots = json.loads(await response.read())
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return None
        if not isinstance(slots, list) or not all(isinstance(slot, dict) for slot in slots):
            return None
        return sum(1 for slot in slots if slot.get("is_processing") is True), len(slots)

    async def _models_listed(self, state: NodeState) -> tuple[ProbeOutcome, str | None]:
        """An attached server is healthy when its `/v1/models` lists the configured model (it may have no
        `/health`)."""
        headers = self._headers_for(state.id)
        try:
            async with self.session.get(
                state.node.endpoint + "/v1/models", headers=headers, allow_redirects=False
            ) as response:
                status, body = response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if is_local_exhaustion(exc):
                return ProbeOutcome.LOCAL_FAILURE, _describe("GET /v1/models", exc)
            return ProbeOutcome.FAILED, _describe("GET /v1/models", exc)
        if status != 200:
            return ProbeOutcome.FAILED, f"GET /v1/models answered {status}"
        try:
            listed = {item.get("id") for item in json.loads(body).get("data", []) if isinstance(item, dict)}
        except (ValueError, AttributeError, TypeError):
            return ProbeOutcome.FAILED, "GET /v1/models answered something that is not a model list"
        if state.node.model not in listed:
            return ProbeOutcome.FAILED, f"GET /v1/models does not list the model {state.node.model!r}"
        return ProbeOutcome.OK, None

    async def _recover(self, state: NodeState) -> None:
        if not state.breaker.try_half_open(force=True):
            return
        node = state.node
        endpoints = node.capabilities.endpoints
        if "completions" in endpoints or not endpoints:
            path, body = "/v1/completions", {"model": node.model, "prompt": "ping", "max_tokens": 1}
        elif "chat" in endpoints:
            path, body = (
                "/v1/chat/completions",
                {"model": node.model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1},
            )
        else:
            path, body = "/v1/embeddings", {"model": node.model, "input": "ping"}
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.recovery_timeout_s)
            async with self.session.post(
                node.endpoint + path,
                json=body,
                timeout=timeout,
                allow_redirects=False,
                headers=self._headers_for(node.id),
            ) as response:
                await response.read()
                ok = response.status == 200
            error = None if ok else f"recovery probe {path} answered {response.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, error = False, _describe(f"recovery probe {path}", exc)
        except BaseException:
            state.breaker.reopen()
            raise
        if self.table.get(state.id) is not state:
            state.breaker.reopen()
            return
        if ok:
            self.table.record_success(state.id)
            logger.info("node %s: recovery probe ok; breaker closed", state.id)
        else:
            self.table.record_failure(state.id, error or "the recovery probe failed")
            logger.info("node %s: %s; breaker stays open", state.id, error)


def _describe(what: str, exc: BaseException) -> str:
    detail = describe_client_error(exc)
    return f"{what}: {safe_text(detail)}"
