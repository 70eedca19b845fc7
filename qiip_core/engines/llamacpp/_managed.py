"""A llama-server that QIIP launches and owns: planned, launched, verified, and relaunched with rollback.

    launch(policy):    read devices → plan (the planner's estimator, llama-fit-params when installed)
                       → launch with every sizing flag → wait for /health → verify against the plan
    preflight(policy): everything about a relaunch that can be known before the server is touched: the model
                       file (`inspect_model`) and a plan against the memory there will be once this server stops
    relaunch(policy):  stop → launch(new policy, on another GGUF when given); if that fails, launch(previous
                       model and policy) again (automatic sizing is recomputed against the memory free now,
                       custom sizing is replayed exactly); if that fails too, the server is down and
                       `RelaunchError(rolled_back=False)` says so

Draining the node before a relaunch is the gateway's part (it owns the routing table); this class only
ever touches the process. The server keeps its port across relaunches, so the node's endpoint does not
change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from qiip_core._errors import (
    EngineError,
    EngineLaunchError,
    ModelFileError,
    PlanError,
    RelaunchError,
    VerificationError,
)
from qiip_core._violation import FieldNames
from qiip_core.engines.llamacpp._install import InstalledEngine
from qiip_core.engines.llamacpp._launch import launch_spec_for
from qiip_core.engines.llamacpp._modelcheck import inspect_model
from qiip_core.engines.llamacpp._server import LlamaServerProcess, free_port
from qiip_core.nodes import LlamaCppRuntime
from qiip_core.planner import (
    AutoPolicy,
    CustomPolicy,
    DeviceMemory,
    Estimator,
    ModelShape,
    Plan,
    choose_estimator,
    plan,
    read_devices,
    verify_runtime,
)

__all__ = ["ManagedLlamaServer"]

logger = logging.getLogger("qiip.engines")

_BIND_REFUSED = "couldn't bind HTTP server socket"
"""What llama-server logs when its port is taken (tools/server/server.cpp), then it exits with code 1."""
_BIND_ATTEMPTS = 3
"""Starts on a port chosen again after the last one was taken, before the launch fails."""


class ManagedLlamaServer:
    """One managed llama-server on this host.

    Args:
        engine: the installed llama.cpp build; a CPU build plans in CPU mode, a CUDA build requires GPUs.
        model_path: the GGUF file (the first shard of a split family).
        alias: the model name clients use (`--alias`).
        log_path: where the server's output goes (appended across relaunches).
        host: the address it binds.
        port: its port; 0 picks a free one at the first launch and keeps it afterwards.
        threads: CPU threads (`--threads`), None for llama.cpp's default.
        embeddings: serve `/v1/embeddings` instead of generation; an embedding model (one that declares a pooling,
            or an encoder) is always served so.

    Raises:
        ModelFileError: the model file cannot be served (`inspect_model`: missing, not a regular file, not a GGUF,
            truncated, a later shard of a split family, out of bounds, an unknown architecture, a missing tensor); it is
            also a ValueError.
    """

    def __init__(
        self,
        engine: InstalledEngine,
        *,
        model_path: Path,
        alias: str,
        log_path: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        threads: int | None = None,
        embeddings: bool = False,
    ) -> None:
        self.engine = engine
        self.model_path = model_path
        self.alias = alias
        self.log_path = log_path
        self.host = host
        self.port = port or free_port(host)
        self._port_chosen = not port
        self.threads = threads
        self.shape = inspect_model(model_path, engine_version=engine.version)[1]
        self._embeddings_asked = embeddings
        self.embeddings = embeddings or self.shape.embedding_model
        self.process: LlamaServerProcess | None = None
        self.runtime: LlamaCppRuntime | None = None
        self.plan: Plan | None = None
        self.policy: AutoPolicy | CustomPolicy | None = None

    @property
    def endpoint(self) -> str:
        """`http://host:port` of the server."""
        return f"http://{self.host}:{self.port}"

    @property
    def cpu_mode(self) -> bool:
        """True for a CPU build, which plans against system memory."""
        return self.engine.variant != "cuda"

    def _estimator(self, shape: ModelShape | None = None, model_path: Path | None = None) -> Estimator:
        return choose_estimator(
            shape or self.shape,
            model_path or self.model_path,
            fit_params=self.engine.fit_params,
            embeddings=self.embeddings,
        )

    def make_plan(
        self,
        policy: AutoPolicy | CustomPolicy,
        *,
        devices: Sequence[DeviceMemory] | None = None,
        names: FieldNames | None = None,
    ) -> Plan:
        """Plan `policy` against the devices as they are now (or `devices`), without launching anything.

        The Python estimator plans the architectures it models (exact to what llama-server logs);
        `llama-fit-params`, when installed, plans every other one.

        Args:
            policy: the sizing.
            devices: the devices to plan against; None reads them now (NVML, or system memory in CPU mode).
            names: how the caller spells the policy's fields in error messages (`plan`'s `names`).

        Raises:
            PlanError: the policy is invalid, no sizing fits (the message gives the plan's numbers per device), no
                usable device exists, or the architecture is not modelled and llama-fit-params is not installed.
        """
        if devices is None:
            devices = read_devices(allow_cpu=self.cpu_mode)
        return plan(self.shape, devices, policy, estimator=self._estimator(), names=names)

    async def launch(self, policy: AutoPolicy | CustomPolicy, *, startup_timeout_s: float = 300.0) -> LlamaCppRuntime:
        """Plan, launch and verify the server for `policy`.

        Returns:
            The verified runtime record (the node's `llamacpp_runtime`).

        Raises:
            PlanError: the policy is invalid or no sizing fits.
            EngineLaunchError: the server did not become healthy (the log tail is in the message).
            VerificationError: the running server differs from the plan (it is stopped).
        """
        planned = await asyncio.to_thread(self.make_plan, policy)
        for attempt in range(1, _BIND_ATTEMPTS + 1):
            try:
                runtime = await self._launch_planned(planned, startup_timeout_s)
                break
            except EngineLaunchError as exc:
                # A port this object chose was free when chosen, not when llama-server bound it: any process's
                # outgoing connection may take a port of the ephemeral range meanwhile. Choose again.
                if not (self._port_chosen and attempt < _BIND_ATTEMPTS and _BIND_REFUSED in exc.log_tail):
                    raise
                taken, self.port = self.port, free_port(self.host)
                logger.warning(
                    "llama-server %r could not bind port %d (taken since it was chosen); starting it on port %d",
                    self.alias,
                    taken,
                    self.port,
                )
        self.plan, self.policy, self.runtime = planned, policy, runtime
        logger.info(
            "llama-server %r verified: %d slot(s) x %d tokens, K/V %s/%s, %s",
            self.alias,
            planned.slots,
            planned.context_per_slot,
            planned.cache_type_k,
            planned.cache_type_v,
            "CPU mode" if planned.cpu_mode else f"{planned.gpu_layers}/{planned.total_layers} layers on GPU",
        )
        return runtime

    async def _launch_planned(self, planned: Plan, startup_timeout_s: float) -> LlamaCppRuntime:
        """Start the server for `planned` on `self.port`, wait until it is healthy and verify it (stopped on any
        failure)."""
        spec = launch_spec_for(
            planned,
            model_path=self.model_path,
            alias=self.alias,
            host=self.host,
            port=self.port,
            threads=self.threads,
            embeddings=self.embeddings,
        )
        with self.log_path.open("a") as log:
            log.write(f"\n{planned.summary()}\n")
        process = LlamaServerProcess(self.engine.server, spec, self.log_path)
        self.process = process
        await process.start()
        try:
            await process.wait_ready(startup_timeout_s)
            devices_after = await asyncio.to_thread(read_devices, allow_cpu=self.cpu_mode)
            return await verify_runtime(
                planned,
                endpoint=process.endpoint,
                log_path=self.log_path,
                alias=self.alias,
                devices_after=devices_after,
            )
        except BaseException:
            await process.stop()
            raise

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `grace_s`). Idempotent."""
        if self.process is not None:
            await self.process.stop(grace_s)
        self.runtime = None

    def check_model(self, model_path: Path) -> ModelShape:
        """Read a GGUF this server could be relaunched on (its own, or another), without touching the running server.

        Args:
            model_path: the GGUF file (the first shard of a split family).

        Returns:
            Its shape, to validate a sizing policy against.

        Raises:
            ModelFileError: the file cannot be served (`inspect_model`), or it would be served the other way (an
                embedding model on a generation node, or the reverse).
        """
        shape = inspect_model(model_path, engine_version=self.engine.version)[1]
        if (self._embeddings_asked or shape.embedding_model) != self.embeddings:
            served, other = ("embeddings", "generation") if self.embeddings else ("generation", "embeddings")
            raise ModelFileError(
                f"{model_path} would be served for {other}, and this server serves {served}; "
                "launch it as a node of its own.",
                path=model_path,
            )
        return shape

    def devices_after_stop(self) -> list[DeviceMemory]:
        """The devices as they will be once this server stops: what they have free now, plus what its plan holds
        while it runs (a server that exited holds nothing). Reads NVML, or system memory in CPU mode.

        Raises:
            PlanError: the devices cannot be read (no GPU on a CUDA build, NVML failed).
        """
        devices = read_devices(allow_cpu=self.cpu_mode)
        running = self.process is not None and self.process.pid is not None and self.process.returncode is None
        if self.plan is None or not running:
            return devices
        held = {e.index: e.total_mib for e in self.plan.estimate.devices}
        return [replace(d, free_mib=min(d.total_mib, d.free_mib + int(held.get(d.index, 0.0) + 0.5))) for d in devices]

    def preflight(self, policy: AutoPolicy | CustomPolicy, *, model_path: Path | None = None) -> Plan:
        """Check a relaunch before anything stops: the model file (`check_model`, bounded in time and memory) and a
        plan of `policy` against the memory there will be once this server stops (`devices_after_stop`).

        The relaunch plans again once the server is stopped (memory moves meanwhile); this says whether it can
        fit at all, so that a sizing that cannot never drains a node.

        Args:
            policy: the new sizing.
            model_path: another GGUF to serve; None checks the current one again (it may have changed on disk).

        Returns:
            The plan it would launch now.

        Raises:
            ModelFileError: the file cannot be served here.
            PlanError: the policy does not fit (the plan's numbers per device), or the devices cannot be read.
        """
        path = model_path or self.model_path
        shape = self.check_model(path)
        return plan(shape, self.devices_after_stop(), policy, estimator=self._estimator(shape, path))

    async def relaunch(
        self,
        policy: AutoPolicy | CustomPolicy,
        *,
        startup_timeout_s: float = 300.0,
        model_path: Path | None = None,
    ) -> LlamaCppRuntime:
        """Stop the server and launch it with `policy` (on `model_path`, when given); roll back to the previous
        model and policy if that fails.

        Args:
            policy: the new sizing.
            startup_timeout_s: how long each launch may take to become healthy, in seconds.
            model_path: another GGUF to serve under the same alias and port; None keeps the current one. It is read
                before the server stops.

        Returns:
            The new verified runtime record.

        Raises:
            ModelFileError: `model_path` cannot be served here (`check_model`); the server was not touched.
            RelaunchError: the new launch failed. `rolled_back` says whether the previous model and policy run
                again (the node can serve) or not (the server is down: only teardown is left).
        """
        new_shape = self.check_model(model_path) if model_path is not None else None
        previous, previous_model = self.policy, (self.model_path, self.shape)
        await self.stop()
        if model_path is not None and new_shape is not None:
            self.model_path, self.shape = model_path, new_shape
        try:
            return await self.launch(policy, startup_timeout_s=startup_timeout_s)
        except (PlanError, EngineLaunchError, VerificationError, EngineError) as exc:
            failure = exc.message
            logger.warning("relaunch of %r with %s failed: %s", self.alias, policy.sizing, failure)
        self.model_path, self.shape = previous_model
        if previous is None:
            raise RelaunchError(
                f"The relaunch failed and there is no previous sizing to return to: {failure}", rolled_back=False
            )
        try:
            await self.launch(previous, startup_timeout_s=startup_timeout_s)
        except (PlanError, EngineLaunchError, VerificationError, EngineError) as exc:
            raise RelaunchError(
                f"The relaunch failed ({failure}) and so did the rollback to the previous sizing ({exc.message}); "
                "the server is stopped.",
                rolled_back=False,
            ) from exc
        on = f" on {self.model_path.name}" if model_path is not None else ""
        raise RelaunchError(
            f"The relaunch failed and the previous sizing ({previous.sizing}) runs again{on}: {failure}",
            rolled_back=True,
        )
