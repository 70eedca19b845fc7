"""What a daemon runs for deployments: the store, the controller, and the operations the admin API calls.

```
DeploymentService(settings, store=…, observer=…, actuator=…, leadership=…, models_in_use=…)
  start() / aclose()                     the controller's loop (with `[deployments] enabled`)
  apply(data, expected_generation)       parse, resolve the source against the shared model cache, store
  scale / rollout / undo / delete        each a new generation (see `_apply`)
  view(name) / views()                   {name, generation, spec, template, history, deleting, status}
  events(name, after)                    the status's events after a sequence number (followers poll them)
  pool()                                 the host pool as the controller sees it
  add_host(spec) / remove_host(name)     `qiip host add/remove`
```
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from qiip_core._errors import DeploymentConflict, DeploymentInvalid, HostPoolError, ModelFileError, QiipError
from qiip_core._violation import Violation
from qiip_core.catalog import scan_catalog
from qiip_core.config import HostSpec, Settings
from qiip_core.deployments._apply import apply, delete, resolve_source, rollout, scale, undo
from qiip_core.deployments._autoscale import Demand
from qiip_core.deployments._capacity import CapacityPlan, Decode, Load, plan_capacity
from qiip_core.deployments._controller import Actuator, DeploymentController, Observer
from qiip_core.deployments._demand import DemandExchange, DemandMeter, LocalDemandExchange, merge_demands
from qiip_core.deployments._fit import PlannerFit
from qiip_core.deployments._hosts import HostView
from qiip_core.deployments._leader import Leadership
from qiip_core.deployments._placement import PlacementInput
from qiip_core.deployments._reconcile import ReconcileConfig
from qiip_core.deployments._resource import Deployment, DeploymentEvent, DeploymentStatus, Template, utc_now
from qiip_core.deployments._spec import DeploymentSpec, parse_spec
from qiip_core.deployments._store import DeploymentStore
from qiip_core.planner import ModelShape, validate_policy
from qiip_core.routing import ExpectedModel, RoutingTable

__all__ = ["DeploymentService", "expected_models", "read_template_shape"]

logger = logging.getLogger("qiip.deployments")

ACTIVATION_RETRY_AFTER_S = 10.0
"""`Retry-After` of a request refused while a deployment's replicas start, in seconds."""


def expected_models(
    deployments: Sequence[Deployment], statuses: Mapping[str, DeploymentStatus]
) -> dict[str, ExpectedModel]:
    """What a request for each deployment's model meets while no node of it is routable (`RoutingTable.expect`):
    a deployment that scales from zero (autoscaling active, `min` 0) holds it up to `activation_timeout_s` (at
    most `activation_queue` at once per serving process) while a replica starts; one whose replicas are starting
    answers 503 with `Retry-After`; one scaled to 0 by hand says so. Deleted ones are not expected.

    Args:
        deployments: the stored deployments.
        statuses: their statuses, by name.

    Returns:
        `{model: ExpectedModel}`.
    """
    found: dict[str, ExpectedModel] = {}
    for deployment in deployments:
        if deployment.deleting:
            continue
        name, spec = deployment.name, deployment.spec
        policy = spec.autoscale
        status = statuses.get(name)
        desired = status.desired if status is not None and status.desired is not None else spec.replicas
        if policy.mode == "active" and policy.min == 0:
            found[name] = ExpectedModel(
                f"deployment {name} starts a replica on demand (it scales from zero)",
                ACTIVATION_RETRY_AFTER_S,
                wait_s=policy.activation_timeout_s,
                queue=policy.activation_queue,
            )
        elif desired > 0:
            found[name] = ExpectedModel(f"the replicas of deployment {name} are starting", ACTIVATION_RETRY_AFTER_S)
        else:
            found[name] = ExpectedModel(f"deployment {name} has 0 replicas (`qiip deploy scale` sets more)", None)
    return found


def read_template_shape(template: Template, cache_dir: Path) -> ModelShape:
    """The model shape of a llama.cpp template, read from its GGUF in the shared model cache.

    Raises:
        ModelFileError: the file is missing or not a GGUF llama-server can load.
    """
    from qiip_core.engines.llamacpp import read_gguf_metadata  # the engine reads GGUFs; imported when needed

    return ModelShape.from_metadata(read_gguf_metadata(cache_dir / template.source.model))


class DeploymentService:
    """Deployments for one daemon (see the module's map).

    Args:
        settings: the daemon's settings.
        store: deployments, statuses and added hosts.
        observer: reads the fleet for the controller.
        actuator: changes the fleet for the controller.
        leadership: the controller's leader lease.
        models_in_use: the models registered nodes serve that no deployment owns (an apply of such a name is
            refused: clients would be sent to both).
        hub_commit: resolves a hub revision to its commit (vLLM sources not in the shared cache).
        table: the routing table: what this gateway measures in flight, and where it expects the models of
            deployments nothing serves yet (`RoutingTable.expect`); None: no autoscaling, nothing expected.
        meter: this gateway's demand measurements (`DemandMeter`); None: no autoscaling.
        exchange: where gateways share their demand (`create_demand_exchange`); None: this gateway alone.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        store: DeploymentStore,
        observer: Observer,
        actuator: Actuator,
        leadership: Leadership,
        models_in_use: Callable[[], Mapping[str, list[str]]],
        hub_commit: Callable[[str, str], str | None] | None = None,
        table: RoutingTable | None = None,
        meter: DemandMeter | None = None,
        exchange: DemandExchange | None = None,
    ) -> None:
        self.settings = settings
        self.table = table
        self.meter = meter
        self.exchange = exchange or LocalDemandExchange()
        self._share_task: asyncio.Task[None] | None = None
        self._seen: list[tuple[Deployment, DeploymentStatus]] = []
        self.store = store
        self.observer = observer
        self.models_in_use = models_in_use
        self.hub_commit = hub_commit
        cfg = settings.deployments
        self.cache_dir = settings.provisioning.model_cache_dir
        self.config = ReconcileConfig(
            replace_after_s=cfg.replace_after_s,
            start_timeout_s=cfg.start_timeout_s,
            failure_backoff_s=cfg.failure_backoff_s,
            rollout_max_failures=cfg.rollout_max_failures,
            quads_free_for_s=settings.quads.lookahead_s,
            cpu_profile=settings.provisioning.profile == "cpu",
        )
        self.fit = PlannerFit(self._shape_of)
        self.controller = DeploymentController(
            store=store,
            observer=observer,
            actuator=actuator,
            leadership=leadership,
            config=self.config,
            fit=self.fit,
            interval_s=cfg.reconcile_interval_s,
            demand=self.demand if table is not None and meter is not None else None,
        )

    def _shape_of(self, template: Template) -> ModelShape:
        if self.cache_dir is None:
            raise ModelFileError(
                "provisioning.model_cache_dir is not set: the gateway cannot read the shared model cache.",
                path=Path(template.source.model),
            )
        return read_template_shape(template, self.cache_dir)

    def start(self) -> None:
        """Start the controller's loop and the demand sharing (with `deployments.enabled`)."""
        if self.settings.deployments.enabled:
            self.controller.start()
            if self.table is not None:
                self._share_task = asyncio.get_running_loop().create_task(self._share(), name="qiip-demand")

    async def aclose(self) -> None:
        """Stop the controller and the demand sharing, give the lease up, close the store."""
        if self._share_task is not None:
            self._share_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._share_task
            self._share_task = None
        await self.controller.aclose()
        await self.exchange.aclose()
        await self.store.aclose()

    # -- demand ----------------------------------------------------------------------------------------------

    async def demand(self, names: Sequence[str]) -> dict[str, Demand]:
        """The demand of the deployments `names` over this gateway's processes and every other gateway's last
        published record (`merge_demands`): what the controller's autoscaler reads once per pass."""
        assert self.table is not None and self.meter is not None
        own = self.meter.snapshot(self.table, names)
        return merge_demands([own, *await self.exchange.others()])

    def seen(self) -> list[tuple[Deployment, DeploymentStatus]]:
        """The deployments with their statuses as the last sharing pass read them (for `/metrics`; at most one
        reconcile interval old)."""
        return self._seen

    async def _share(self) -> None:
        """Every reconcile interval, in every gateway: expect the models of deployments nothing serves yet (so a
        request for one waits for its replica, or is told it starts), and publish this gateway's demand."""
        while True:
            try:
                deployments = await self._expect()
                if self.meter is not None and self.table is not None:
                    await self.exchange.publish(self.meter.snapshot(self.table, [d.name for d in deployments]))
            except QiipError as exc:
                logger.warning("the deployments' demand could not be shared: %s", exc.message)
            await asyncio.sleep(self.settings.deployments.reconcile_interval_s)

    async def _expect(self) -> list[Deployment]:
        """Read the deployments and their statuses; expect their models in the table (`expected_models`)."""
        deployments = await self.store.deployments()
        statuses = await self.store.statuses()
        if self.table is not None:
            self.table.expect("deployments", expected_models(deployments, statuses))
        self._seen = [(d, statuses[d.name]) for d in deployments if d.name in statuses]
        return deployments

    async def _changed(self) -> None:
        """A deployment changed here: run a controller pass now, and expect its model at once in this gateway
        (the others within a reconcile interval)."""
        self.controller.wake()
        if self._share_task is not None:
            await self._expect()

    # -- changes ---------------------------------------------------------------------------------------------

    async def _resolve(self, spec: DeploymentSpec) -> Template:
        if spec.engine.serves_gguf and self.cache_dir is None:
            raise DeploymentInvalid(
                f"A {spec.engine.label} deployment needs provisioning.model_cache_dir: the shared model cache the "
                "hosts mount.",
                violations=[
                    Violation(
                        "source",
                        "the gateway has no provisioning.model_cache_dir (the shared model cache the hosts mount; "
                        "set [provisioning] model_cache_dir or QIIP_PROVISIONING__MODEL_CACHE_DIR and restart it)",
                    )
                ],
            )
        cache = self.cache_dir or Path("/nonexistent")
        catalog = await asyncio.to_thread(scan_catalog, cache)
        source = await asyncio.to_thread(resolve_source, spec, catalog, cache, hub_commit=self.hub_commit)
        template = Template(engine=spec.engine, source=source, runtime=spec.runtime)
        if spec.engine.serves_gguf:
            try:
                shape = await asyncio.to_thread(self._shape_of, template)
            except ModelFileError as exc:
                raise DeploymentInvalid(
                    f"The model of source cannot be used: {exc.message}",
                    violations=[Violation("source", exc.message)],
                ) from None
            problems = validate_policy(
                template.runtime.policy(), train_context=shape.n_ctx_train, devices=(), shape=shape
            )
            if problems:
                fields = [
                    Violation(f"runtime.{'capacity' if spec.runtime.capacity else 'sizing'}.{v.field}", v.message)
                    for v in problems
                ]
                raise DeploymentInvalid(
                    "The runtime does not suit the model: " + " ".join(v.message for v in problems), violations=fields
                )
        return template

    def _check_name(self, name: str) -> None:
        owners = self.models_in_use().get(name)
        if owners:
            raise DeploymentConflict(
                f"Model {name!r} is served by node(s) no deployment owns ({', '.join(sorted(owners)[:5])}); a "
                "deployment of that name would share its clients with them. Remove them, or name the deployment "
                "otherwise."
            )

    async def apply(
        self, data: Mapping[str, Any], *, expected_generation: int | None = None
    ) -> tuple[Deployment, bool]:
        """Apply a deployment document (decoded TOML or JSON).

        Raises:
            DeploymentInvalid: a field breaks a rule, the source does not resolve, or the sizing does not suit the
                model (`.violations`).
            DeploymentConflict: a stale generation, a deployment being deleted, or a name other nodes serve.
            DeploymentNotFound: a generation was expected of a deployment that does not exist.
        """
        spec = parse_spec(data)
        self._check_name(spec.name)
        result = await apply(self.store, spec, resolve=self._resolve, expected_generation=expected_generation)
        await self._changed()
        return result

    async def plan(self, data: Mapping[str, Any], *, load: Load, decode: Decode) -> CapacityPlan:
        """Plan the replicas a deployment document needs for `load` on the pool as it is now, applying nothing
        (`qiip deploy plan`; see `_capacity`).

        Raises:
            DeploymentInvalid: as `apply` (the document is checked and its source resolved the same way).
            QiipError: the fleet cannot be read.
        """
        spec = parse_spec(data)
        template = await self._resolve(spec)
        deployment = Deployment(spec=spec, template=template)
        hosts = await self.pool()
        given = PlacementInput(
            now=utc_now(), cpu_profile=self.config.cpu_profile, host_failures={}, holding=frozenset()
        )
        window = spec.placement.quads_free_for_s
        return await asyncio.to_thread(  # the planner proves fits: CPU work, off the event loop
            plan_capacity,
            deployment,
            hosts,
            load=load,
            decode=decode,
            fit=self.fit,
            given=given,
            quads_free_for_s=float(window if window is not None else self.config.quads_free_for_s),
        )

    async def scale(self, name: str, replicas: int, *, expected_generation: int | None = None) -> Deployment:
        """Set the replica count (see `_apply.scale`)."""
        result = await scale(self.store, name, replicas, expected_generation=expected_generation)
        await self._changed()
        return result

    async def rollout(
        self, name: str, changes: Mapping[str, Any], *, expected_generation: int | None = None
    ) -> tuple[Deployment, bool]:
        """Roll out a new source, engine or runtime (see `_apply.rollout`)."""
        result = await rollout(
            self.store, name, resolve=self._resolve, changes=changes, expected_generation=expected_generation
        )
        await self._changed()
        return result

    async def undo(self, name: str, *, expected_generation: int | None = None) -> Deployment:
        """Go back to the previous template (see `_apply.undo`)."""
        result = await undo(self.store, name, expected_generation=expected_generation)
        await self._changed()
        return result

    async def delete(self, name: str) -> Deployment:
        """Delete: drain and tear down every replica, then the record (see `_apply.delete`)."""
        result = await delete(self.store, name)
        await self._changed()
        return result

    # -- reads -----------------------------------------------------------------------------------------------

    async def view(self, name: str) -> dict[str, Any]:
        """`{…deployment, status}` of one deployment.

        Raises:
            DeploymentNotFound: there is none.
        """
        deployment = await self.store.get(name)
        status = await self.store.status(name)
        return _view(deployment, status)

    async def views(self) -> list[dict[str, Any]]:
        """Every deployment with its status, by name."""
        deployments = await self.store.deployments()
        statuses = await self.store.statuses()
        return [_view(d, statuses.get(d.name)) for d in deployments]

    async def events(self, name: str, *, after: int = 0) -> list[DeploymentEvent]:
        """The deployment's kept events with a sequence number above `after`.

        Raises:
            DeploymentNotFound: there is no such deployment.
        """
        await self.store.get(name)
        status = await self.store.status(name)
        return [e for e in (status.events if status else ()) if e.seq > after]

    async def status(self, name: str) -> DeploymentStatus | None:
        """The stored status of `name`, if the controller wrote one."""
        return await self.store.status(name)

    async def pool(self) -> list[HostView]:
        """The host pool as the controller sees it (QUADS over `quads.lookahead_s`).

        Raises:
            QiipError: the fleet cannot be read.
        """
        observation = await self.observer.observe()
        return observation.hosts(self.config.quads_free_for_s)

    async def add_host(self, data: Mapping[str, Any]) -> HostSpec:
        """Add a host to the pool (`qiip host add`).

        Raises:
            HostPoolError: the host is declared in the configuration already (change it there), or the store fails.
            pydantic.ValidationError: a field is invalid (the route maps it to 422 with the field).
        """
        spec = HostSpec.model_validate(dict(data))
        if any(h.name == spec.name for h in self.settings.hosts):
            raise HostPoolError(f"Host {spec.name} is declared in the configuration ([[hosts]]); change it there.")
        result = await self.store.add_host(spec)
        self.controller.wake()
        return result

    async def remove_host(self, name: str) -> None:
        """Remove an added host from the pool; replicas on it are moved to other hosts.

        Raises:
            HostNotInPool: no added host has this name.
            HostPoolError: the host is declared in the configuration.
        """
        if any(h.name == name for h in self.settings.hosts):
            raise HostPoolError(f"Host {name} is declared in the configuration ([[hosts]]); remove it there.")
        await self.store.remove_host(name)
        self.controller.wake()


def _view(deployment: Deployment, status: DeploymentStatus | None) -> dict[str, Any]:
    data = deployment.view()
    data["status"] = status.view() if status is not None else None
    return data
