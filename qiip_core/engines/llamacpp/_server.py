"""Run `llama-server` as a supervised child process: spell out its sizing, wait for health, stop it.

`LaunchSpec.argv` passes every flag that decides memory and concurrency (`--ctx-size`, `--parallel`,
`--kv-unified`/`--no-kv-unified`, `--cache-type-k/v`, `--flash-attn`, `--gpu-layers`, `--fit off`), so what
runs is what was planned: llama-server's own defaults and its `--fit` adjustment never decide, and
`LLAMA_ARG_*` variables of the parent's environment are removed from the child's.

`LlamaServerProcess` starts the program in its own session with stdout and stderr going to one log file.
On Linux the child also gets a parent-death signal (SIGTERM), so a crashed or killed parent does not leave
a server holding memory and a port. Readiness is `GET /health` answering 200 (`qiip_core.health.probe_health`: no
redirect followed, a host name's addresses checked against the default endpoint allowlist): 503 ("Loading model")
and a refused connection while the process lives are progress; an exit or the deadline is a failure carrying the
tail of the log.

The parent-death signal follows the thread that forked the child: start servers from a thread that lives
as long as they should (the event loop's thread), not from a short-lived worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from qiip_core._childenv import parent_death_signal, runtime_environment
from qiip_core._errors import EngineLaunchError
from qiip_core.health import health_session, probe_health
from qiip_core.nodes import EndpointPolicy

__all__ = ["CACHE_TYPES", "POOLINGS", "LaunchSpec", "LlamaServerProcess", "free_port"]

logger = logging.getLogger("qiip.engines")

POOLINGS = frozenset({"none", "mean", "cls", "last", "rank"})
"""Values of `--pooling` (`enum llama_pooling_type`)."""

CACHE_TYPES = frozenset({"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"})
"""KV cache types llama-server accepts for `--cache-type-k` and `--cache-type-v`. The quantised ones need
a head size that is a multiple of their block size (32)."""

FlashAttn = Literal["auto", "on", "off"]

_POLL_INTERVAL_S = 0.1
_HEALTH_TIMEOUT_S = 5.0
_HEALTH_CONNECT_TIMEOUT_S = 1.0
_TAIL_LINES = 40


class _NotReady(Exception):
    """Internal: the deadline passed; carries the last health answer."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (bind to port 0 and release it).

    Args:
        host: the address the port will be bound on.

    Returns:
        The port number. Another process may take it before it is used; callers that must be sure retry.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """Everything `llama-server` is started with. Invalid values raise ValueError at construction.

    Sizing is aggregate: `ctx_size` tokens of KV cache shared by `slots` parallel sequences. With
    `kv_unified` (the default) any slot may use the whole cache; without it each slot gets
    `ctx_size / slots`.
    """

    model: Path
    """The GGUF file, or the first shard of a split family."""
    alias: str
    """The model name clients send (`--alias`); `/v1/models` lists it."""
    host: str = "127.0.0.1"
    """Address to listen on (`--host`)."""
    port: int = 0
    """TCP port (`--port`); 0 means `LlamaServerProcess.start` picks a free one."""
    ctx_size: int
    """Aggregate context in tokens across all slots (`--ctx-size`)."""
    slots: int = 1
    """Parallel sequences (`--parallel`)."""
    kv_unified: bool = True
    """One KV buffer shared by all slots (`--kv-unified`) or one per slot (`--no-kv-unified`)."""
    cache_type_k: str = "f16"
    """K cache type (`--cache-type-k`), one of `CACHE_TYPES`."""
    cache_type_v: str = "f16"
    """V cache type (`--cache-type-v`), one of `CACHE_TYPES`."""
    flash_attn: FlashAttn = "auto"
    """Flash attention (`--flash-attn`): `on`, `off` or `auto`."""
    gpu_layers: int | Literal["all"] = "all"
    """Layers offloaded to the GPU (`--gpu-layers`); a CPU build ignores it with a warning in the log."""
    metrics: bool = True
    """Serve Prometheus metrics at `/metrics` (`--metrics`)."""
    embeddings: bool = False
    """Serve `/v1/embeddings` (`--embeddings --pooling POOLING`) instead of generation."""
    pooling: str = "mean"
    """With `embeddings`, how token vectors become one (`--pooling`, one of `POOLINGS`): the model's own when
    its GGUF declares one (bge: `cls`, Qwen3-Embedding: `last`; another gives wrong vectors), mean for a model
    that declares none."""
    ubatch_size: int | None = None
    """Micro-batch and batch in tokens (`--ubatch-size` and `--batch-size`, equal); None keeps llama-server's
    defaults. Embeddings need every input in one micro-batch (see `qiip_core.planner._embeddings`)."""
    threads: int | None = None
    """CPU threads (`--threads`); None lets llama.cpp choose."""
    log_verbosity: int = 4
    """`--log-verbosity`: 4 logs the context, KV cache (types, sizes, cells) and offload lines that sizing
    checks read; 3 is llama-server's terse default."""
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    """Further arguments, appended last (so they override the flags above)."""

    def __post_init__(self) -> None:
        if not self.alias.strip() or "," in self.alias:
            raise ValueError(f"alias must be a non-empty name without commas, got {self.alias!r}.")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be between 0 (pick a free one) and 65535, got {self.port}.")
        if self.ctx_size < 1:
            raise ValueError(f"ctx_size must be a positive number of tokens, got {self.ctx_size}.")
        if self.slots < 1:
            raise ValueError(f"slots must be at least 1, got {self.slots}.")
        if self.ctx_size < self.slots:
            raise ValueError(f"ctx_size ({self.ctx_size}) must be at least slots ({self.slots}).")
        for name in ("cache_type_k", "cache_type_v"):
            value = getattr(self, name)
            if value not in CACHE_TYPES:
                raise ValueError(f"{name} must be one of {sorted(CACHE_TYPES)}, got {value!r}.")
        if self.flash_attn not in ("auto", "on", "off"):
            raise ValueError(f"flash_attn must be 'auto', 'on' or 'off', got {self.flash_attn!r}.")
        if self.gpu_layers != "all" and (not isinstance(self.gpu_layers, int) or self.gpu_layers < 0):
            raise ValueError(f"gpu_layers must be 'all' or a number of layers >= 0, got {self.gpu_layers!r}.")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be None (llama.cpp chooses) or at least 1, got {self.threads}.")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {sorted(POOLINGS)}, got {self.pooling!r}.")
        if self.ubatch_size is not None and self.ubatch_size < 1:
            raise ValueError(
                f"ubatch_size must be None (llama-server's default) or at least 1, got {self.ubatch_size}."
            )
        if not 0 <= self.log_verbosity <= 5:
            raise ValueError(f"log_verbosity must be between 0 and 5, got {self.log_verbosity}.")

    @property
    def ctx_per_slot(self) -> int:
        """The context one slot may use, in tokens: all of it when unified, else an equal share."""
        return self.ctx_size if self.kv_unified else self.ctx_size // self.slots

    def argv(self, binary: Path) -> list[str]:
        """The command line for `binary` (a `llama-server`).

        Args:
            binary: the program to run.

        Returns:
            The argument vector, program first.

        Raises:
            ValueError: `port` is 0; `LlamaServerProcess.start` chooses the port before building the command.
        """
        if self.port == 0:
            raise ValueError("port is 0; choose a port first (LlamaServerProcess.start does, with free_port).")
        args = [
            str(binary),
            "--model",
            str(self.model),
            "--alias",
            self.alias,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--ctx-size",
            str(self.ctx_size),
            "--parallel",
            str(self.slots),
            "--kv-unified" if self.kv_unified else "--no-kv-unified",
            "--cache-type-k",
            self.cache_type_k,
            "--cache-type-v",
            self.cache_type_v,
            "--flash-attn",
            self.flash_attn,
            "--gpu-layers",
            str(self.gpu_layers),
            # --fit (on by default) would resize what is not given; everything is given, and a planner
            # decides, so it stays off.
            "--fit",
            "off",
            "--log-colors",
            "off",
            "--log-verbosity",
            str(self.log_verbosity),
        ]
        if self.metrics:
            args.append("--metrics")
        if self.embeddings:
            args += ["--embeddings", "--pooling", self.pooling]
        if self.ubatch_size is not None:
            args += ["--batch-size", str(self.ubatch_size), "--ubatch-size", str(self.ubatch_size)]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        args += list(self.extra_args)
        return args


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send `sig` to the process group `pgid`; a group that is gone already is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class LlamaServerProcess:
    """One `llama-server` child process.

    Args:
        binary: the `llama-server` program.
        spec: what to launch; a port of 0 is replaced by a free one at `start`.
        log_path: the file that receives the process's stdout and stderr (truncated at start).
    """

    def __init__(self, binary: Path, spec: LaunchSpec, log_path: Path) -> None:
        self.binary = binary
        self.spec = spec
        self.log_path = log_path
        self._process: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        """The process id once started, else None."""
        return self._process.pid if self._process is not None else None

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has ended and been reaped (negative: killed by that signal)."""
        return self._process.returncode if self._process is not None else None

    @property
    def endpoint(self) -> str:
        """The base URL, `http://host:port` (IPv6 hosts in brackets)."""
        host = f"[{self.spec.host}]" if ":" in self.spec.host else self.spec.host
        return f"http://{host}:{self.spec.port}"

    @property
    def argv(self) -> list[str]:
        """The command line the process was (or will be) started with."""
        return self.spec.argv(self.binary)

    async def start(self) -> None:
        """Spawn the process; it loads the model in the background (see `wait_ready`).

        Raises:
            EngineLaunchError: already started, or the program cannot be executed.
        """
        if self._process is not None:
            raise EngineLaunchError(f"llama-server for {self.spec.alias!r} was already started.")
        if self.spec.port == 0:
            self.spec = replace(self.spec, port=free_port(self.spec.host))
        argv = self.spec.argv(self.binary)
        # A minimal environment: never the daemon's secrets (`qiip_core._childenv`).
        env = runtime_environment()
        # On an abort ggml forks a debugger to print a backtrace, which can hang a crashed server (and its forks
        # outlive it); the assertion itself is still logged.
        env["GGML_NO_BACKTRACE"] = "1"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self.log_path.open("wb") as log:
                self._process = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    # SIGKILL, not SIGTERM: a dying multi-threaded parent signals the child more than once, and
                    # llama-server answers a second SIGTERM with `exit(1)` in the middle of its cleanup, which can
                    # hang it. With its parent gone there is no one to stop gracefully for.
                    preexec_fn=parent_death_signal(signal.SIGKILL),
                )
        except OSError as exc:
            raise EngineLaunchError(f"llama-server cannot be started from {self.binary}: {exc}.") from exc
        logger.info(
            "started llama-server pid %s for %r on %s (log %s)",
            self._process.pid,
            self.spec.alias,
            self.endpoint,
            self.log_path,
        )

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until `GET /health` answers 200.

        Args:
            timeout_s: the deadline in seconds for loading the model.

        Raises:
            EngineLaunchError: the process exited (the message has the exit code and the log's last lines),
                was never started, or did not become ready within `timeout_s` (it is stopped then).
        """
        process = self._process
        if process is None:
            raise EngineLaunchError("llama-server was not started; call start() first.")
        deadline = asyncio.get_running_loop().time() + timeout_s
        exited = asyncio.ensure_future(process.wait())
        try:
            await self._poll_health(process, exited, deadline)
            return
        except _NotReady as exc:
            last = str(exc)
        finally:
            if not exited.done():
                exited.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await exited
        await self.stop()
        tail = self.log_tail(_TAIL_LINES)
        raise EngineLaunchError(
            f"llama-server for {self.spec.alias!r} was not ready on {self.endpoint} within {timeout_s:g} s "
            f"(last: {last}) and was stopped. Last lines of {self.log_path}:\n{tail}",
            log_tail=tail,
        )

    async def _poll_health(
        self, process: asyncio.subprocess.Process, exited: asyncio.Future[int], deadline: float
    ) -> None:
        loop = asyncio.get_running_loop()
        last = "no answer yet"
        # The server is this machine's: a host name's addresses are checked against the default allowlist
        # (loopback allowed; link-local, the metadata service and the like refused).
        session = health_session(
            policy=EndpointPolicy(), timeout_s=_HEALTH_TIMEOUT_S, connect_timeout_s=_HEALTH_CONNECT_TIMEOUT_S
        )
        async with session:
            while True:
                if process.returncode is not None:
                    raise self._exited(process.returncode)
                answer = await probe_health(self.endpoint, session=session)
                if answer.alive:
                    logger.info("llama-server %r is ready on %s", self.spec.alias, self.endpoint)
                    return
                if answer.error is not None:
                    # Refused while the socket is not yet listening: progress as long as the process lives.
                    last = f"{type(answer.error).__name__}: {answer.error}"
                else:
                    # 503 {"error": {"message": "Loading model"}} while the model loads.
                    last = f"HTTP {answer.status}: {answer.body[:200].decode('utf-8', 'replace')}"
                if loop.time() >= deadline:
                    raise _NotReady(last)
                # Sleep one poll interval, but wake at once if the process exits.
                await asyncio.wait({exited}, timeout=_POLL_INTERVAL_S)

    def _exited(self, returncode: int) -> EngineLaunchError:
        tail = self.log_tail(_TAIL_LINES)
        how = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with code {returncode}"
        return EngineLaunchError(
            f"llama-server for {self.spec.alias!r} {how} before it was ready. Last lines of {self.log_path}:\n{tail}",
            log_tail=tail,
        )

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop the process and anything it forked: SIGTERM, wait up to `grace_s` seconds, then SIGKILL; always
        reaped.

        The server runs in a process group of its own (`start_new_session`), so the signals go to the group: a
        child it forked (a crash handler, say) never outlives it. Safe to call more than once, before `start`, and
        after the server exited by itself (what it left behind is still killed).

        Args:
            grace_s: seconds to wait for a clean exit after SIGTERM.
        """
        process = self._process
        if process is None:
            return
        if process.returncode is not None:
            _signal_group(process.pid, signal.SIGKILL)
            return
        _signal_group(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), grace_s)
        except TimeoutError:
            logger.warning("llama-server pid %s ignored SIGTERM for %s s; killing it", process.pid, grace_s)
            _signal_group(process.pid, signal.SIGKILL)
            await process.wait()
        _signal_group(process.pid, signal.SIGKILL)
        logger.info("llama-server pid %s stopped (exit status %s)", process.pid, process.returncode)

    async def aclose(self) -> None:
        """Stop the process with the default grace period; the same as `stop()`."""
        await self.stop()

    def log_tail(self, n: int = _TAIL_LINES) -> str:
        """The last `n` lines of the log, or an empty string if there is none yet.

        Args:
            n: how many lines.

        Returns:
            The lines, joined with newlines, without a trailing one.
        """
        try:
            with self.log_path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 256 * 1024))
                data = f.read()
        except OSError:
            return ""
        lines = data.decode("utf-8", errors="replace").splitlines()
        return "\n".join(lines[-n:]) if n > 0 else ""
