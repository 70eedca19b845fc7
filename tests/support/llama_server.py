"""Run a real llama-server for a test: started from a launch spec, healthy before the test uses it, always stopped."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from qiip_core.engines.llamacpp import LaunchSpec, LlamaServerProcess

READY_TIMEOUT_S = 60.0
"""Seconds a server may take to load its model and answer `/health`."""


@contextlib.asynccontextmanager
async def running(binary: Path, spec: LaunchSpec, log: Path) -> AsyncIterator[LlamaServerProcess]:
    """A llama-server for `spec`, healthy, stopped on the way out.

    Args:
        binary: the `llama-server` to run.
        spec: what to launch; port 0 takes a free port.
        log: the file the server's output goes to.

    Yields:
        The running process; its `endpoint` is the server's base URL.

    Raises:
        EngineLaunchError: the server exited or was not ready within `READY_TIMEOUT_S`.
    """
    process = LlamaServerProcess(binary, spec, log)
    await process.start()
    try:
        await process.wait_ready(timeout_s=READY_TIMEOUT_S)
        yield process
    finally:
        await process.stop()


@contextlib.contextmanager
def serving(binary: Path, spec: LaunchSpec, log: Path) -> Iterator[str]:
    """`running`, for synchronous tests: a llama-server on its own event loop; yields its base URL."""
    loop = asyncio.new_event_loop()
    manager = running(binary, spec, log)
    try:
        process = loop.run_until_complete(manager.__aenter__())
        try:
            yield process.endpoint
        finally:
            loop.run_until_complete(manager.__aexit__(None, None, None))
    finally:
        loop.close()


def held_llama_server(directory: Path, binary: Path) -> tuple[Path, Path]:
    """A `llama-server` in `directory/bin` that waits at its start until a gate file exists, then runs `binary`: a
    model that loads for as long as a test wants.

    Returns:
        (the held program, the gate to create to let it start).
    """
    gate = directory / "gate"
    held = directory / "bin" / "llama-server"
    held.parent.mkdir()
    held.write_text(f'#!/bin/sh\nwhile [ ! -e "{gate}" ]; do sleep 0.05; done\nexec "{binary}" "$@"\n')
    held.chmod(0o755)
    return held, gate
