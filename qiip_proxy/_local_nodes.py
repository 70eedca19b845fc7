"""llama.cpp nodes the daemon launches on its own host (`[[local_nodes]]`, and what `qiip up` uses).

Each is a `llama-server` child process with every sizing flag explicit; once it answers `/health` it is
registered as a managed, ephemeral node (not persisted: the next start launches it again). The children
die with the daemon: they are stopped on shutdown, and a parent-death signal covers a daemon that is
killed outright.
"""

from __future__ import annotations

import asyncio
import logging

from qiip_core import QiipError
from qiip_core.config import LocalNodeConfig, Settings
from qiip_core.discovery import Registry
from qiip_core.engines.llamacpp import LaunchSpec, LlamaCppInstaller, LlamaServerProcess, read_gguf_metadata
from qiip_core.nodes import Engine, Node, NodeCapabilities, NodeStatus

__all__ = ["LocalNodes"]

logger = logging.getLogger("qiip.local")

_DEFAULT_CONTEXT_PER_SLOT = 4096


class LocalNodes:
    """Launches, registers and stops the daemon's own llama.cpp nodes.

    Args:
        settings: the daemon's settings (`local_nodes`, `engines.llamacpp`, `state_dir`).
        registry: where ready nodes are registered (ephemerally).
    """

    def __init__(self, settings: Settings, registry: Registry) -> None:
        self.settings = settings
        self.registry = registry
        self.processes: dict[str, LlamaServerProcess] = {}
        self.errors: dict[str, str] = {}
        self.ready: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Launch every configured local node in the background."""
        for config in self.settings.local_nodes:
            self._tasks.append(asyncio.create_task(self._launch(config), name=f"qiip-local-{config.id}"))

    async def _launch(self, config: LocalNodeConfig) -> None:
        try:
            installed = LlamaCppInstaller(self.settings.engines.llamacpp).find_installed()
            if installed is None:
                raise QiipError(
                    "llama-server is not installed; run `qiip engine install llama.cpp` (add --cpu on a "
                    "machine without an NVIDIA GPU)."
                )
            metadata = await asyncio.to_thread(read_gguf_metadata, config.gguf)
            ctx_size = config.ctx_size or config.slots * min(metadata.n_ctx_train, _DEFAULT_CONTEXT_PER_SLOT)
            spec = LaunchSpec(
                model=config.gguf,
                alias=config.model,
                host=config.host,
                port=config.port,
                ctx_size=ctx_size,
                slots=config.slots,
                embeddings=config.embeddings,
                threads=config.threads or None,
            )
            log_path = self.settings.state_dir / "logs" / f"{config.id}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            process = LlamaServerProcess(installed.server, spec, log_path)
            self.processes[config.id] = process
            logger.info("launching local node %s: %s (log %s)", config.id, config.gguf, log_path)
            await process.start()
            await process.wait_ready(config.startup_timeout_s)
        except (QiipError, OSError, ValueError) as exc:
            message = exc.message if isinstance(exc, QiipError) else str(exc)
            self.errors[config.id] = message
            logger.error("local node %s failed to start: %s", config.id, message)
            return
        capabilities = NodeCapabilities(endpoints=("embeddings",) if config.embeddings else ("chat", "completions"))
        node = Node(
            id=config.id,
            endpoint=process.endpoint,
            model=config.model,
            engine=Engine.LLAMA_CPP,
            managed=True,
            status=NodeStatus.UNKNOWN,
            capabilities=capabilities,
        )
        await self.registry.register(node, ephemeral=True)
        self.ready.add(config.id)
        logger.info("local node %s is serving %r at %s", config.id, config.model, process.endpoint)

    def states(self) -> dict[str, str]:
        """Each local node's launch state: `starting`, `serving` or `failed`."""
        return {
            c.id: "failed" if c.id in self.errors else "serving" if c.id in self.ready else "starting"
            for c in self.settings.local_nodes
        }

    async def aclose(self) -> None:
        """Stop launching and stop every local llama-server."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(p.stop() for p in self.processes.values()), return_exceptions=True)
