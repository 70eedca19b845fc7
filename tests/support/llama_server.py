"""Run a real llama-server for a planner test and read back what it logged."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from qiip_core.engines.llamacpp import LaunchSpec, LlamaServerProcess
from qiip_core.planner import DeviceMemory

TOLERANCE = 0.02
"""Estimates must be within 2% of what llama-server logs."""

LOG_RESOLUTION_MIB = 0.005
"""The log prints MiB with two decimals: half the last digit is the most rounding can hide."""


@contextlib.asynccontextmanager
async def running(binary: Path, spec: LaunchSpec, log: Path) -> AsyncIterator[LlamaServerProcess]:
    """A started, healthy llama-server, stopped (by its PID) on exit."""
    process = LlamaServerProcess(binary, spec, log)
    await process.start()
    try:
        await process.wait_ready(timeout_s=60)
        yield process
    finally:
        await process.stop()


def synthetic_cpu(free_mib: float) -> DeviceMemory:
    """A CPU-mode device with `free_mib` free: the planner's view of a host of that size."""
    return DeviceMemory(index=0, name="CPU (planned)", total_mib=10**7, free_mib=int(free_mib), kind="cpu")


def assert_close(estimated: float, logged: float, what: str) -> None:
    """Within 2% of the log, or within the log's rounding for figures of a few hundredths of a MiB."""
    bound = max(TOLERANCE * logged, LOG_RESOLUTION_MIB)
    # A hair over the bound: 0.125 is logged as 0.12, exactly half a digit away.
    assert abs(estimated - logged) <= bound + 1e-9, f"{what}: estimated {estimated:.3f} MiB, logged {logged}"
