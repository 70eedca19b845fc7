"""The deployment controller: level-triggered, idempotent, one active per fleet.

```
every deployments.reconcile_interval_s, or at once after an apply, scale, rollout or delete:
  campaign for the leader lease                    (not leading: do nothing; another gateway acts)
  read every deployment and its stored status
  observe the fleet once                           replicas by deployment, the host pool (`Observer`)
  decide, off the event loop, for each deployment, by name:
      reconcile(...)                               pure: the next steps and the new status
  act on each step through the `Actuator`          setup, teardown, forget, remove the record
  store each status that changed
```

Deciding asks the planner whether each template fits each host shape. A fit check that proves many questions at
once (`BatchFitCheck`: `PlannerFit`, over worker processes) gets them all before the decisions that read them:
the pass is decided once with what is proven, each question it cannot answer noted (and answered "not proven yet"),
and when some were noted they are proven together and the pass decided again. A pass that proves nothing (every
pass but those with new deployments, templates or host shapes) is decided once. The first decision places nothing
where a proof was missing, so the second fills hosts the first left free: it may no longer ask of a shape whose
hosts it has all taken (a proof made for nothing: 4 of 300 at 1,000 hosts in `bench/placement.py`), and what it
asks anew is proven when asked.

It keeps nothing between passes that a restart would lose: a controller that starts (or takes over from a
dead gateway) reads the same records and takes the same steps. Each step is idempotent at the actuator: a
setup on a host another operation holds is refused (`HostBusy`) and tried again on a later pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from qiip_core._errors import HostBusy, QiipError, TooManySetups
from qiip_core.deployments._autoscale import Demand, autoscale
from qiip_core.deployments._hosts import HostPool, HostView
from qiip_core.deployments._leader import Leadership
from qiip_core.deployments._placement import BatchFitCheck, Fit, FitCheck
from qiip_core.deployments._reconcile import (
    Action,
    Decision,
    Forget,
    ObservedReplica,
    Place,
    ReconcileConfig,
    RemoveDeployment,
    Retire,
    reconcile,
)
from qiip_core.deployments._resource import (
    MAX_EVENTS,
    AutoscaleStatus,
    Deployment,
    DeploymentEvent,
    DeploymentStatus,
    Template,
    utc_now,
)
from qiip_core.deployments._store import DeploymentStore
from qiip_core.planner import DeviceMemory

__all__ = ["Actuator", "DeploymentController", "Observation", "Observer"]

logger = logging.getLogger("qiip.deployments")


@dataclass(frozen=True)
class Observation:
    """The fleet as one pass sees it."""

    replicas: dict[str, list[ObservedReplica]]
    """Every replica, by deployment name."""
    hosts: Callable[[float], list[HostView]]
    """The pool, with QUADS judged over a window of that many seconds from now."""


class Observer(Protocol):
    """Reads the fleet: nodes, provisioning tasks, the host pool, QUADS, telemetry."""

    async def observe(self) -> Observation:
        """The fleet now.

        Raises:
            QiipError: a backend cannot be read (the pass is skipped).
        """
        ...


class Actuator(Protocol):
    """Changes the fleet: the provisioning operations, or an in-memory stand-in in `bench/`."""

    async def place(self, deployment: Deployment, host: str, template: Template) -> None:
        """Start setting a replica up on `host` (returns once started).

        Raises:
            QiipError: refused before anything ran (`HostBusy`, `TooManySetups`, …).
        """
        ...

    async def retire(self, host: str, *, reason: str, force: bool) -> None:
        """Start draining and tearing down the replica on `host` (without the drain when `force`).

        Raises:
            QiipError: refused before anything ran.
        """
        ...

    async def forget(self, host: str, *, reason: str) -> None:
        """Deregister the node on `host` without reaching the host (it is gone).

        Raises:
            QiipError: the registry refused.
        """
        ...


class DeploymentController:
    """Runs reconcile passes while this gateway leads (see the module's map).

    Args:
        store: deployments and statuses.
        observer: reads the fleet.
        actuator: changes it.
        leadership: the leader lease.
        config: the pass's settings.
        fit: the planner's fit check (a `BatchFitCheck` is asked each pass's new questions at once).
        interval_s: seconds between passes (a change wakes it at once).
        demand: the measured demand of the deployments named, over every serving process and gateway
            (`{model: Demand}`, read once per pass, before deciding), for autoscaling; None: no deployment is
            autoscaled.
        clock: the current time (tests and the benchmark give their own).
    """

    def __init__(
        self,
        *,
        store: DeploymentStore,
        observer: Observer,
        actuator: Actuator,
        leadership: Leadership,
        config: ReconcileConfig,
        fit: FitCheck,
        interval_s: float = 2.0,
        demand: Callable[[Sequence[str]], Awaitable[Mapping[str, Demand]]] | None = None,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self.store = store
        self.observer = observer
        self.actuator = actuator
        self.leadership = leadership
        self.config = config
        self.fit = fit
        self.interval_s = interval_s
        self.demand = demand
        self.clock = clock
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.passes = 0
        """Passes run while leading (for tests and the benchmark)."""

    @property
    def leading(self) -> bool:
        """Whether this gateway led at its last campaign."""
        return self.leadership.token > 0

    def wake(self) -> None:
        """Run a pass now (after an apply, scale, rollout or delete)."""
        self._wake.set()

    def start(self) -> None:
        """Start the loop in the background."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="qiip-deployments")

    async def run(self) -> None:
        """Campaign and reconcile until cancelled."""
        while True:
            try:
                await self.tick()
            except QiipError as exc:
                logger.warning("a deployment pass stopped: %s", exc.message)
            except Exception:  # one broken pass must not end the controller
                logger.exception("a deployment pass failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)

    async def aclose(self) -> None:
        """Stop the loop and give the leader lease up."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.leadership.resign()

    async def tick(self) -> bool:
        """One pass over every deployment, if this gateway leads.

        Returns:
            Whether a pass ran (False: another gateway leads).

        Raises:
            QiipError: the store or the fleet cannot be read (nothing was changed).
        """
        if not await self.leadership.campaign():
            return False
        deployments = await self.store.deployments()
        statuses = await self.store.statuses()
        observation = await self.observer.observe()
        demands = await self.demand([d.name for d in deployments]) if self.demand is not None and deployments else None
        # Deciding is CPU work (the planner proves fits): one trip off the event loop for the whole pass, so the
        # daemon keeps answering. Acting (the actuator's I/O) comes back to the loop.
        decided = await asyncio.to_thread(self._decide, deployments, statuses, observation, demands, self.clock())
        for deployment, previous, decision, now in decided:
            await self._act_on(deployment, previous, decision, now)
        self.passes += 1
        return True

    def pool_for(self, deployment: Deployment, observation: Observation, pools: dict[float, HostPool]) -> HostPool:
        """The pool as `deployment` sees it (QUADS over its window), built once per window and pass."""
        window = deployment.spec.placement.quads_free_for_s
        seconds = float(window if window is not None else self.config.quads_free_for_s)
        if seconds not in pools:
            pools[seconds] = HostPool.of(observation.hosts(seconds))
        return pools[seconds]

    def _decide(
        self,
        deployments: list[Deployment],
        statuses: dict[str, DeploymentStatus],
        observation: Observation,
        demands: Mapping[str, Demand] | None,
        now: datetime,
    ) -> list[tuple[Deployment, DeploymentStatus | None, Decision, datetime]]:
        pools: dict[float, HostPool] = {}
        fit = self.fit
        if isinstance(fit, BatchFitCheck):
            noted = _Noting(fit)
            decided = self._decide_with(noted, deployments, statuses, observation, demands, now, pools)
            if not noted.questions:
                return decided  # every answer was a proof made already: this is the pass
            del decided  # each decision holds an explain of every host: not two passes' worth at once
            made = fit.prove_all(noted.questions)
            logger.debug("deployments: %d planner proof(s) made for this pass, together", made)
        return self._decide_with(fit, deployments, statuses, observation, demands, now, pools)

    def _decide_with(
        self,
        fit: FitCheck,
        deployments: list[Deployment],
        statuses: dict[str, DeploymentStatus],
        observation: Observation,
        demands: Mapping[str, Demand] | None,
        now: datetime,
        pools: dict[float, HostPool],
    ) -> list[tuple[Deployment, DeploymentStatus | None, Decision, datetime]]:
        taken: dict[str, str] = {}  # hosts this pass placed on, so the next deployment does not pick them too
        decided = []
        for deployment in deployments:
            previous = statuses.get(deployment.name)
            replicas = observation.replicas.get(deployment.name, [])
            scaled = self._autoscale(deployment, previous, replicas, demands, now)
            scaling, held = scaled if scaled is not None else (None, 0)
            desired = scaling.desired if scaling is not None else None
            decision = reconcile(
                deployment,
                previous,
                observation.replicas.get(deployment.name, []),
                self.pool_for(deployment, observation, pools),
                now=now,
                config=self.config,
                fit=fit,
                desired=desired,
                owner=self.leadership.owner,
                busy=taken,
            )
            for action in decision.actions:
                if isinstance(action, Place):
                    taken[action.host] = deployment.name
            if scaling is not None and decision.status is not None:
                decision.status = _with_autoscale(decision.status, previous, scaling, held, deployment, now)
            decided.append((deployment, previous, decision, now))
        return decided

    def _autoscale(
        self,
        deployment: Deployment,
        previous: DeploymentStatus | None,
        replicas: list[ObservedReplica],
        demands: Mapping[str, Demand] | None,
        now: datetime,
    ) -> tuple[AutoscaleStatus, int] | None:
        policy = deployment.spec.autoscale
        if policy.mode == "off" or demands is None or deployment.deleting:
            return None
        state = previous.autoscale if previous is not None else AutoscaleStatus()
        held = state.desired
        if held is None or previous is None or previous.observed_generation != deployment.generation:
            held = deployment.spec.replicas  # a new spec (`qiip deploy scale`) sets the starting point
        held = max(policy.min, min(policy.max, held))
        if policy.mode == "active":
            state = state.model_copy(update={"desired": held})
        ready = sum(1 for r in replicas if r.serving)
        demand = demands.get(deployment.name, Demand())
        return autoscale(policy, state, demand=demand, replicas=held, ready=ready, now=now), held

    async def _act_on(
        self, deployment: Deployment, previous: DeploymentStatus | None, decision: Decision, now: datetime
    ) -> None:
        status = decision.status
        assert status is not None
        refusals: list[str] = []
        unplaced: set[str] = set()
        for action in decision.actions:
            if isinstance(action, RemoveDeployment):
                await self.store.remove(deployment.name)
                logger.info("deployment %r deleted: no replica is left", deployment.name)
                return
            refusal = await self._act(deployment, action)
            if refusal is not None:
                refusals.append(refusal)
                if isinstance(action, Place):
                    unplaced.add(action.host)
        if refusals:
            status = _with_refusals(status, now, refusals, unplaced)
        if previous is None or _changed(previous, status):
            await self.store.put_status(status)

    async def _act(self, deployment: Deployment, action: Action) -> str | None:
        try:
            if isinstance(action, Place):
                await self.actuator.place(deployment, action.host, action.template)
                logger.info("deployment %r: replica placed on %s (%s)", deployment.name, action.host, action.reason)
            elif isinstance(action, Retire):
                await self.actuator.retire(
                    action.host, reason=f"deployment {deployment.name!r}: {action.reason}", force=action.force
                )
                logger.info(
                    "deployment %r: retiring the replica on %s (%s)", deployment.name, action.host, action.reason
                )
            elif isinstance(action, Forget):
                await self.actuator.forget(action.host, reason=action.reason)
                logger.warning(
                    "deployment %r: forgot the replica on %s (%s)", deployment.name, action.host, action.reason
                )
        except (HostBusy, TooManySetups) as exc:
            return f"waiting: {exc.message}"
        except QiipError as exc:
            logger.warning(
                "deployment %r: %s on %s refused: %s",
                deployment.name,
                type(action).__name__.lower(),
                getattr(action, "host", "?"),
                exc.message,
            )
            return f"{type(action).__name__.lower()} on {getattr(action, 'host', '?')} refused: {exc.message}"
        return None


class _Noting:
    """A fit check that answers from the proofs made and notes every other question (answered "not proven yet",
    a refusal: a decision made with one is decided again once the questions are proven)."""

    def __init__(self, fit: BatchFitCheck) -> None:
        self.fit = fit
        self.questions: list[tuple[Template, tuple[DeviceMemory, ...]]] = []

    def __call__(self, template: Template, devices: tuple[DeviceMemory, ...]) -> Fit:
        found = self.fit.proven(template, devices)
        if found is None:
            self.questions.append((template, devices))
            return _NOT_PROVEN
        return found


_NOT_PROVEN = Fit(False, "not proven yet")


def _with_refusals(
    status: DeploymentStatus, now: datetime, messages: Sequence[str], unplaced: set[str]
) -> DeploymentStatus:
    # A placement the actuator refused did not happen: its `placed` event goes; the refusal is said instead, once
    # while it stays the same pass after pass.
    events = [e for e in status.events if not (e.kind == "placed" and e.at == now and e.host in unplaced)]
    said = {e.message for e in events if e.kind in ("waiting", "refused")}
    seq = status.events[-1].seq if status.events else 0
    for message in messages:
        if message in said:
            continue
        said.add(message)
        seq += 1
        kind = "waiting" if message.startswith("waiting") else "refused"
        events.append(DeploymentEvent(at=now, kind=kind, message=message, seq=seq))
    return status.model_copy(update={"events": tuple(events[-MAX_EVENTS:])})


def _with_autoscale(
    status: DeploymentStatus,
    previous: DeploymentStatus | None,
    scaling: AutoscaleStatus,
    held: int,
    deployment: Deployment,
    now: datetime,
) -> DeploymentStatus:
    before = previous.autoscale if previous is not None else AutoscaleStatus()
    message = None
    if scaling.desired is not None and scaling.desired != held:
        message = ("scaled", f"autoscaler: {held} → {scaling.desired} replicas ({scaling.reason})")
    elif deployment.spec.autoscale.mode == "recommend" and scaling.recommendation != before.recommendation:
        message = ("recommendation", f"autoscaler recommends {scaling.recommendation} replicas ({scaling.reason})")
    events = status.events
    if message is not None:
        seq = events[-1].seq if events else 0
        events = (*events, DeploymentEvent(at=now, kind=message[0], message=message[1], seq=seq + 1))[-MAX_EVENTS:]
    return status.model_copy(update={"autoscale": scaling, "events": events})


def _changed(before: DeploymentStatus, after: DeploymentStatus) -> bool:
    # Field-by-field equality of the models (no serialisation): a pass that changed nothing writes nothing.
    return before.model_copy(update={"updated_at": after.updated_at}) != after
