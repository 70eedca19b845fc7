"""Local llama.cpp nodes before they start: the default sizing, and the planning `qiip up` does for every model.

```
default_local_policy(train_context, slots=…, context_per_slot=…)   the one default sizing of a local node
plan_local_nodes(engine, [LocalModel, …], sizing=…, …) -> [PlannedLocalNode]
share_devices(devices, fit_target_mib=…, models=N)                  what one of N automatic plans may take
```

Every model is read (`inspect_model`, through `ManagedLlamaServer`) and planned as the daemon will plan it before
anything starts, so a file that cannot be served or a sizing that cannot fit is refused at once, naming the file.
With several models and an automatic sizing, each is planned against an equal share of what is free beyond the fit
target and launched with exactly that sizing, so that the first does not take everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from qiip_core._errors import PlanError
from qiip_core._violation import FieldNames
from qiip_core.engines.llamacpp._handoff import LocalNodePlan
from qiip_core.engines.llamacpp._install import InstalledEngine
from qiip_core.engines.llamacpp._managed import ManagedLlamaServer
from qiip_core.engines.llamacpp._relaunched import RelaunchedSizing, RelaunchedSizings
from qiip_core.planner import CONTEXT_STEP, AutoPolicy, CacheType, CustomPolicy, DeviceMemory, Plan, read_devices

__all__ = [
    "DEFAULT_CONTEXT_PER_SLOT",
    "DEFAULT_SLOTS",
    "LocalModel",
    "PlannedLocalNode",
    "default_local_policy",
    "plan_local_nodes",
    "share_devices",
]

DEFAULT_CONTEXT_PER_SLOT = 4096
"""Tokens each slot of a local node gets by default, at most (the model's training context when smaller)."""

DEFAULT_SLOTS = 2
"""Parallel slots of a local node by default."""


def default_local_policy(
    train_context: int,
    *,
    slots: int | None = None,
    context_per_slot: int | None = None,
    cache_type: CacheType = "f16",
    fit_target_mib: int = 512,
) -> CustomPolicy:
    """The sizing of a local node not sized automatically: what is given, and the defaults for the rest.

    The defaults: `DEFAULT_SLOTS` slots of min(training context, `DEFAULT_CONTEXT_PER_SLOT`) tokens each, aligned
    down to 256 (at least 256), with an F16 K/V cache. `qiip up` and a `[[local_nodes]]` entry without `sizing`
    both size so.

    Args:
        train_context: the model's training context in tokens.
        slots: parallel slots; None for `DEFAULT_SLOTS`.
        context_per_slot: tokens each slot is guaranteed; None for the default above.
        cache_type: the K/V cache type.
        fit_target_mib: memory to keep free on every device, in MiB.

    Returns:
        The policy (not yet checked against the model: `plan` does that).
    """
    if context_per_slot is None:
        context_per_slot = max(
            CONTEXT_STEP, min(train_context, DEFAULT_CONTEXT_PER_SLOT) // CONTEXT_STEP * CONTEXT_STEP
        )
    return CustomPolicy(
        fit_target_mib=fit_target_mib,
        context_per_slot=context_per_slot,
        slots=DEFAULT_SLOTS if slots is None else slots,
        cache_type=cache_type,
    )


@dataclass(frozen=True)
class LocalModel:
    """A model to serve on this host."""

    alias: str
    """The name clients use as `model`."""
    path: Path
    """The GGUF (the first shard of a split family): a file given, or an artifact's entrypoint."""
    artifact_id: str | None = None
    """The artifact's whole id when `path` is its entrypoint; None for a file."""


@dataclass(frozen=True)
class PlannedLocalNode:
    """A local node as planned before anything starts."""

    node: LocalNodePlan
    """What the daemon launches (its part of the hand-off)."""
    plan: Plan
    """The sizing planned now, against this machine's free memory (or its share of it): `launched`'s. An automatic
    sizing is planned again at launch, against the memory free then."""
    relaunch: RelaunchedSizing | None = None
    """The node's recorded relaunch, when one applies (`RelaunchedSizings.peek`): the daemon launches its sizing
    instead of `node.sizing`, unless it does not plan here (`relaunch_refused`)."""
    relaunch_refused: str | None = None
    """Why `relaunch`'s sizing does not plan here (the planner's message): the daemon drops the record and
    launches `node.sizing`."""

    @property
    def launched(self) -> AutoPolicy | CustomPolicy:
        """The sizing the daemon will launch: the recorded relaunch's when it applies and plans, else
        `node.sizing`."""
        if self.relaunch is not None and self.relaunch_refused is None:
            return self.relaunch.policy
        return self.node.sizing


def share_devices(devices: Sequence[DeviceMemory], *, fit_target_mib: int, models: int) -> list[DeviceMemory]:
    """The devices as one of `models` automatic plans may see them: the fit target, plus an equal share of what is
    free beyond it, so that all the plans together still leave the target free.

    Args:
        devices: the devices as they are.
        fit_target_mib: memory to keep free on every device, in MiB.
        models: how many plans share them; 1 or less returns `devices` as they are.
    """
    if models <= 1:
        return list(devices)
    return [
        replace(d, free_mib=min(d.free_mib, fit_target_mib + max(0, d.free_mib - fit_target_mib) // models))
        for d in devices
    ]


def _left_after(devices: Sequence[DeviceMemory], planned: Plan) -> list[DeviceMemory]:
    """The devices with what `planned` will hold taken off their free memory."""
    return [
        replace(d, free_mib=max(0, d.free_mib - int(e.total_mib + 0.5)))
        for d, e in zip(devices, planned.estimate.devices, strict=True)
    ]


def plan_local_nodes(
    engine: InstalledEngine,
    models: Sequence[LocalModel],
    *,
    sizing: Literal["auto", "custom"] = "custom",
    slots: int | None = None,
    context_per_slot: int | None = None,
    cache_type: CacheType = "f16",
    fit_target_mib: int = 512,
    embeddings: bool = False,
    id_prefix: str = "local",
    devices: Sequence[DeviceMemory] | None = None,
    names: FieldNames | None = None,
    relaunched: RelaunchedSizings | None = None,
) -> list[PlannedLocalNode]:
    """Check every model and plan it as the daemon will, one after another, before anything starts.

    Each model is planned against the memory the previous ones leave. With several models and an automatic sizing,
    each is planned against an equal share of what is free beyond the fit target (`share_devices`) and launched with
    exactly the sizing found (a custom policy), so that together they leave the target free; one model alone keeps
    its automatic policy, planned again at launch.

    Args:
        engine: the llama.cpp build to plan and launch with (a CPU build plans against system memory).
        models: what to serve, in launch order.
        sizing: `auto` lets the planner choose context, slots and cache type; `custom` uses the values below.
        slots: parallel slots (custom); None for the default (`default_local_policy`).
        context_per_slot: tokens each slot is guaranteed (custom); None for the default.
        cache_type: the K/V cache type (custom).
        fit_target_mib: memory to keep free on every device, in MiB.
        embeddings: serve `/v1/embeddings`; an embedding model is served so anyway.
        id_prefix: the first node's id; the next ones are `<id_prefix>-2`, `<id_prefix>-3`, ….
        devices: the devices to plan against; None reads them (NVML, or system memory for a CPU build).
        names: how the caller spells the policy's fields in the messages (`plan`'s `names`).
        relaunched: the daemon's relaunch records (its state directory's): a node with a recorded relaunch that
            applies (`RelaunchedSizings.peek`, the rule the daemon's `recall` applies) is planned with the
            relaunch's sizing, which the daemon launches instead of the configured one; nothing is changed.
            None plans the configured sizings only.

    Returns:
        One planned node per model, in order.

    Raises:
        ModelFileError: a model file cannot be served (`inspect_model`: missing, not a regular file, not a GGUF,
            truncated, a later shard, a missing shard, a shape out of bounds, an unknown architecture, a missing
            tensor); also a ValueError. Each is found in bounded time and memory.
        PlanError: the devices cannot be read, or a sizing is invalid or does not fit; the message starts with
            the file's name and gives the plan's numbers.
    """
    free = list(devices) if devices is not None else read_devices(allow_cpu=engine.variant != "cuda")
    share = len(models) if sizing == "auto" and len(models) > 1 else 1
    planned: list[PlannedLocalNode] = []
    for index, model in enumerate(models):
        server = ManagedLlamaServer(engine, model_path=model.path, alias=model.alias, log_path=Path("/dev/null"))
        policy: AutoPolicy | CustomPolicy
        if sizing == "auto":
            policy = AutoPolicy(fit_target_mib=fit_target_mib)
        else:
            policy = default_local_policy(
                server.shape.n_ctx_train,
                slots=slots,
                context_per_slot=context_per_slot,
                cache_type=cache_type,
                fit_target_mib=fit_target_mib,
            )
        budget = share_devices(free, fit_target_mib=fit_target_mib, models=share)
        configured: Plan | None = None
        if share > 1:
            # The daemon launches exactly this sizing: re-planning 'auto' there would take all that is left.
            configured = _plan(server, model, policy, budget, names)
            policy = CustomPolicy(
                fit_target_mib=fit_target_mib,
                context_per_slot=configured.context_per_slot,
                slots=configured.slots,
                cache_type=configured.cache_type_k,
            )
        try:
            node = LocalNodePlan(
                id=id_prefix if index == 0 else f"{id_prefix}-{index + 1}",
                model=model.alias,
                gguf=model.path.absolute(),  # the daemon reads it in its own process: never relative
                artifact_id=model.artifact_id,
                sizing=policy,
                embeddings=embeddings or server.embeddings,
            )
        except ValidationError:
            # A sizing the record refuses: the planner says why, with the file's name and in the caller's words.
            _plan(server, model, policy, budget, names)
            raise
        # What the daemon will launch: a recorded relaunch that applies and plans, else the configured sizing.
        relaunch = relaunched.peek(node.config()) if relaunched is not None else None
        refused: str | None = None
        made: Plan | None = None
        if relaunch is not None:
            try:
                made = server.make_plan(relaunch.policy, devices=budget)
            except PlanError as exc:
                refused = exc.message
        if made is None:
            made = configured or _plan(server, model, policy, budget, names)
        free = _left_after(free, made)
        planned.append(PlannedLocalNode(node=node, plan=made, relaunch=relaunch, relaunch_refused=refused))
    return planned


def _plan(
    server: ManagedLlamaServer,
    model: LocalModel,
    policy: AutoPolicy | CustomPolicy,
    budget: Sequence[DeviceMemory],
    names: FieldNames | None,
) -> Plan:
    """`server`'s plan of `policy` against `budget`.

    Raises:
        PlanError: as `ManagedLlamaServer.make_plan`, with the file's name first.
    """
    try:
        return server.make_plan(policy, devices=budget, names=names)
    except PlanError as exc:
        raise PlanError(f"{model.path.name}: {exc.message}", violations=exc.violations) from None
