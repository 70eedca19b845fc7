"""llama.cpp nodes the daemon launches on its own host (`[[local_nodes]]`, and what `qiip up` uses).

Each is a managed llama-server (`ManagedLlamaServer`): planned by the sizing planner, launched with every
sizing flag explicit, verified against its plan, then registered as a managed, ephemeral node carrying its
`llamacpp_runtime` record (not persisted: the next start launches it again). The children die with the
daemon: they are stopped on shutdown, and a parent-death signal covers a daemon that is killed outright.

Until a local node is registered, the routing table expects its model (`RoutingTable.expected`): a request for it
gets 503 `model_unavailable` with `Retry-After`, never 404, and `/health` says the gateway is starting.

The nodes `qiip up` planned come with its hand-off (`LocalNodeHandoff`): the daemon launches them on the engine,
file, artifact and sizing `qiip up` resolved, without looking any of them up again. It reads each GGUF once more
(`ManagedLlamaServer`), because the file may have changed since and the launch plans against the memory free then.
A `[[local_nodes]]` entry of the configuration is resolved here: its artifact, and its default sizing once its GGUF
is read.

A node relaunched with another sizing keeps it across restarts: the relaunch is recorded in the state
directory and the next start launches that sizing, unless the node's configuration changed since
(`RelaunchedSizings`).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from qiip_core import ConfigError, PlanError, QiipError
from qiip_core.catalog import artifact_entrypoint, resolve_artifact_id
from qiip_core.config import LocalNodeConfig, Settings, StateDirLock
from qiip_core.discovery import Registry
from qiip_core.engines.llamacpp import (
    InstalledEngine,
    LlamaCppInstaller,
    LocalNodeHandoff,
    LocalNodePlan,
    ManagedLlamaServer,
    RelaunchedSizings,
    default_local_policy,
)
from qiip_core.nodes import Engine, LlamaCppRuntime, Node, NodeCapabilities, NodeStatus
from qiip_core.planner import AutoPolicy, CustomPolicy, parse_policy
from qiip_core.routing import ExpectedModel, RoutingTable

__all__ = ["STARTING_RETRY_AFTER_S", "LocalNodes"]

logger = logging.getLogger("qiip.local")

STARTING_RETRY_AFTER_S = 5.0
"""`Retry-After` of a request for the model of a local node still starting: its load takes seconds to minutes, and
the `openai` library retries twice, honouring it."""


class LocalNodes:
    """Launches, registers and stops the daemon's own llama.cpp nodes.

    Args:
        settings: the daemon's settings (`local_nodes`, `engines.llamacpp`, `state_dir`).
        registry: where ready nodes are registered (ephemerally).
        table: the routing table whose `expected` models this keeps (`expected_models`); None: none.
        handoff: what `qiip up` planned (its nodes are `settings.local_nodes`, as `LocalNodePlan.config` gives
            them); None for a daemon started otherwise.

    Raises:
        ConfigError: a local node's `sizing` is not a valid policy, or another daemon runs local nodes from the
            same state directory (`StateDirLock`).
    """

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        *,
        table: RoutingTable | None = None,
        handoff: LocalNodeHandoff | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.table = table
        self.handoff = handoff
        self._planned: dict[str, LocalNodePlan] = {n.id: n for n in handoff.nodes} if handoff is not None else {}
        self.servers: dict[str, ManagedLlamaServer] = {}
        self.errors: dict[str, str] = {}
        self.ready: set[str] = set()
        self.removed: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._policies: dict[str, AutoPolicy | CustomPolicy | None] = {}
        self.relaunched = RelaunchedSizings(settings.state_dir)
        """The sizings local nodes were relaunched with, launched again on the next start."""
        for index, config in enumerate(settings.local_nodes):
            try:
                self._policies[config.id] = parse_policy(config.sizing) if config.sizing is not None else None
            except PlanError as exc:
                raise ConfigError(
                    f"Invalid setting local_nodes.{index}.sizing (node {config.id!r}): {exc.message}"
                ) from exc
        # Held until aclose: another daemon's local nodes would share these node ids and their logs.
        self._lock = StateDirLock(settings.state_dir) if settings.local_nodes else None
        self._expect()

    def start(self) -> None:
        """Launch every configured local node in the background, one after another.

        One at a time, so each is planned against the memory the previous ones left free rather than all against
        the same free memory at once.
        """
        self._tasks.append(asyncio.create_task(self._launch_all(), name="qiip-local-nodes"))

    async def _launch_all(self) -> None:
        for config in self.settings.local_nodes:
            try:
                await self._launch(config)
            except Exception as exc:
                # A failure `_launch` does not foresee fails that node only: the others still launch, and
                # `/health` says `failed` rather than `starting` forever.
                logger.exception("local node %s failed to start", config.id)
                await self._fail(config.id, f"{type(exc).__name__}: {exc}")

    async def _fail(self, node_id: str, message: str) -> None:
        """Record that the local node `node_id` failed to start (`message`, logged) and stop its llama-server if
        it started: one that is not registered would only hold memory."""
        self.errors[node_id] = message
        self.ready.discard(node_id)
        server = self.servers.get(node_id)
        if server is not None:
            await server.stop()
        self._expect()

    def _engine(self) -> InstalledEngine:
        """The llama.cpp build to launch with: the one `qiip up` planned with, else the installed one."""
        if self.handoff is not None:
            return self.handoff.engine
        installed = LlamaCppInstaller(self.settings.engines.llamacpp).find_installed()
        if installed is None:
            raise QiipError(
                "llama-server is not installed; run `qiip engine install llama.cpp` (add --cpu on a "
                "machine without an NVIDIA GPU)."
            )
        return installed

    async def _launch(self, config: LocalNodeConfig) -> None:
        planned = self._planned.get(config.id)
        try:
            installed = self._engine()
            if planned is not None:
                artifact, model_path = planned.artifact_id, planned.gguf
            else:
                artifact, model_path = await asyncio.to_thread(self._model_path, config)
            log_path = self.settings.state_dir / "logs" / f"{config.id}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            server = await asyncio.to_thread(
                ManagedLlamaServer,
                installed,
                model_path=model_path,
                alias=config.model,
                log_path=log_path,
                host=config.host,
                port=config.port,
                threads=config.threads or None,
                embeddings=planned.embeddings if planned is not None else config.embeddings,
            )
            self.servers[config.id] = server
            policy = (
                planned.sizing
                if planned is not None
                else self._policies.get(config.id) or default_local_policy(server.shape.n_ctx_train, slots=config.slots)
            )
            logger.info("launching local node %s: %s (log %s)", config.id, model_path, log_path)
            runtime = await self._launch_server(config, server, policy)
            capabilities = NodeCapabilities(endpoints=("embeddings",) if server.embeddings else ("chat", "completions"))
            # A ValidationError (a ValueError) here fails this node, and stops the server it launched.
            node = Node(
                id=config.id,
                endpoint=server.endpoint,
                model=config.model,
                engine=Engine.LLAMA_CPP,
                managed=True,
                status=NodeStatus.UNKNOWN,
                capabilities=capabilities,
                llamacpp_runtime=runtime,
                artifact_id=artifact,
            )
        except (QiipError, OSError, ValueError) as exc:
            message = exc.message if isinstance(exc, QiipError) else str(exc)
            logger.error("local node %s failed to start: %s", config.id, message)
            await self._fail(config.id, message)
            return
        await self.registry.register(node, ephemeral=True)
        self.ready.add(config.id)
        self._expect()
        logger.info("local node %s is serving %r at %s", config.id, config.model, server.endpoint)

    async def _launch_server(
        self, config: LocalNodeConfig, server: ManagedLlamaServer, configured: AutoPolicy | CustomPolicy
    ) -> LlamaCppRuntime:
        """Launch with the sizing of the node's last relaunch when one is recorded, else with `configured`."""
        recalled = await asyncio.to_thread(self.relaunched.recall, config)
        if recalled is not None:
            logger.info(
                "local node %s: launching with the sizing of its relaunch, %s, instead of the configured sizing "
                "(%s); relaunch it, or change its configuration, to replace it",
                config.id,
                recalled.describe(),
                configured.model_dump(mode="json"),
            )
            try:
                return await server.launch(recalled.policy, startup_timeout_s=config.startup_timeout_s)
            except PlanError as exc:
                await asyncio.to_thread(
                    self.relaunched.forget,
                    config.id,
                    f"the sizing of its relaunch ({recalled.describe()}) does not plan here any more: {exc.message} "
                    "Launching the configured sizing instead",
                )
        return await server.launch(configured, startup_timeout_s=config.startup_timeout_s)

    def remember_relaunch(self, node_id: str, policy: AutoPolicy | CustomPolicy) -> None:
        """Record that the local node `node_id` was relaunched with `policy`, for the next start (no-op for a node
        that is not a configured local node)."""
        config = next((c for c in self.settings.local_nodes if c.id == node_id), None)
        if config is None:
            return
        try:
            self.relaunched.remember(config, policy)
        except OSError as exc:
            logger.warning(
                "local node %s: could not record its relaunch in %s (%s); the next start uses the configured sizing",
                node_id,
                self.relaunched.path,
                exc,
            )
            return
        logger.info(
            "local node %s: relaunch sizing recorded in %s; the next start uses it", node_id, self.relaunched.path
        )

    def _model_path(self, config: LocalNodeConfig) -> tuple[str | None, Path]:
        """The whole artifact id (None for a file) and the GGUF to serve of a configured node (`qiip up` resolved
        its own nodes'): the configured file, or the entrypoint of `artifact_id` (an id or its prefix: an acquired
        manifest revision, else a generation of the Hugging Face cache)."""
        if config.gguf is not None:
            return None, config.gguf
        assert config.artifact_id is not None  # the settings require one of the two
        whole = resolve_artifact_id(self.settings, config.artifact_id)
        return whole, artifact_entrypoint(self.settings, whole)

    def startup_timeout_s(self, node_id: str) -> float:
        """How long the node's llama-server may take to load (its `startup_timeout_s`)."""
        for config in self.settings.local_nodes:
            if config.id == node_id:
                return config.startup_timeout_s
        return 300.0

    def states(self) -> dict[str, str]:
        """Each local node's launch state: `starting`, `serving`, `failed`, or `removed` (through the admin API;
        its llama-server is stopped and it stays out until the daemon restarts)."""
        return {
            c.id: "removed"
            if c.id in self.removed
            else "failed"
            if c.id in self.errors
            else "serving"
            if c.id in self.ready
            else "starting"
            for c in self.settings.local_nodes
        }

    def expected_models(self) -> dict[str, ExpectedModel]:
        """The models of local nodes not removed, by name, with what each waits for: a node registered (whose model
        the table serves then, so this is not consulted), one starting, or one that failed to start."""
        states = self.states()
        # Per model, the local node nearest to serving it: ready, then starting, then failed.
        ranked: dict[str, tuple[int, ExpectedModel]] = {}
        for config in self.settings.local_nodes:
            state = states[config.id]
            if state == "serving":
                entry = (0, ExpectedModel(f"its local node {config.id} is ready and being registered", 1.0))
            elif state == "starting":
                entry = (
                    1,
                    ExpectedModel(
                        f"its local node {config.id} is starting (loading the model)", STARTING_RETRY_AFTER_S
                    ),
                )
            elif state == "failed":
                entry = (
                    2,
                    ExpectedModel(f"its local node {config.id} failed to start (the daemon's log says why)", None),
                )
            else:
                continue
            if config.model not in ranked or entry[0] < ranked[config.model][0]:
                ranked[config.model] = entry
        return {model: expected for model, (_, expected) in ranked.items()}

    def _expect(self) -> None:
        if self.table is not None:
            self.table.expect("local_nodes", self.expected_models())

    @property
    def starting(self) -> bool:
        """True while a local node is still starting (its model loading)."""
        return "starting" in self.states().values()

    def forget(self, node_id: str) -> None:
        """Record that the local node `node_id` was removed (its server is stopped by the remove operation)."""
        if node_id in self.ready or node_id in self.servers:
            self.ready.discard(node_id)
            self.servers.pop(node_id, None)
            self.removed.add(node_id)
            self._expect()

    async def aclose(self) -> None:
        """Stop launching and stop every local llama-server."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(s.stop() for s in self.servers.values()), return_exceptions=True)
        if self._lock is not None:
            self._lock.release()
