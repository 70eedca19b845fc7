"""Running real llama-server processes for the planner's tests, and comparing what they log with estimates."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from qiip_core.engines.llamacpp import LaunchSpec, LlamaServerProcess
from qiip_core.planner import DeviceMemory, MemoryEstimate, ModelShape, estimate, parse_server_log

TOLERANCE = 0.02
"""Estimates must be within 2% of what llama-server logs."""

LOG_ROUNDING_MIB = 0.005 + 1e-9
"""llama-server prints MiB with two decimals: a tiny buffer may differ from its figure by half a hundredth."""


def synthetic_cpu(free_mib: float) -> DeviceMemory:
    """A CPU device with `free_mib` free, for planning; the server itself has the machine's memory."""
    return DeviceMemory(index=0, name="CPU (planned)", total_mib=10**7, free_mib=int(free_mib), kind="cpu")


@contextlib.asynccontextmanager
async def running(binary: Path, spec: LaunchSpec, log: Path) -> AsyncIterator[LlamaServerProcess]:
    """A llama-server for `spec`, healthy, stopped on the way out."""
    process = LlamaServerProcess(binary, spec, log)
    await process.start()
    try:
        await process.wait_ready(timeout_s=60)
        yield process
    finally:
        await process.stop()


async def load_once(
    binary: Path, model: Path, log: Path, *, ctx: int, slots: int, flash_attn: str, cache: str, embeddings: bool = False
) -> None:
    """Start a llama-server with this sizing (one thread, CPU), wait until it serves, and stop it."""
    spec = LaunchSpec(
        model=model,
        alias="measured",
        ctx_size=ctx,
        slots=slots,
        cache_type_k=cache,
        cache_type_v=cache,
        flash_attn=flash_attn,  # type: ignore[arg-type]
        gpu_layers=0,
        threads=1,
        embeddings=embeddings,
    )
    async with running(binary, spec, log):
        pass


def assert_close(estimated: float, logged: float, what: str) -> None:
    """Within `TOLERANCE` of the logged figure (which has two decimals)."""
    assert abs(estimated - logged) <= max(TOLERANCE * logged, LOG_ROUNDING_MIB), (
        f"{what}: estimated {estimated:.2f} MiB, logged {logged}"
    )


def assert_estimate_matches_log(result: MemoryEstimate, log: Path) -> None:
    """Every cache, the compute buffer and the weights of a CPU-mode estimate agree with the log within 2%."""
    facts = parse_server_log(log.read_text())
    (device,) = result.devices
    assert [c.kind for c in result.caches] == [c.kind for c in facts.caches], "the caches differ in kind"
    for planned, logged in zip(result.caches, facts.caches, strict=True):
        assert planned.cells == logged.cells, planned.kind
        assert (planned.type_k, planned.type_v) == (logged.type_k, logged.type_v), planned.kind
        # llama_memory_recurrent logs the model's block count, not the recurrent blocks it holds.
        assert planned.kind == "recurrent" or len(planned.layers) == logged.layers, planned.kind
        assert_close(planned.mib, logged.mib, f"{planned.kind} cache")
    assert_close(device.context_mib, sum(c.mib for c in facts.caches), "all caches")
    assert_close(device.compute_mib, facts.compute_mib["CPU"], "compute")
    weights = facts.model_mib["CPU_Mapped"] + facts.model_mib.get("CPU_REPACK", 0.0)
    assert_close(device.model_mib, weights, "weights")


def budget(shape: ModelShape, *, context: int, slots: int, cache: str = "f16", target: int = 512) -> float:
    """Free MiB at which exactly this sizing fits on a CPU device (with 1 MiB to spare)."""
    result = estimate(
        shape,
        aggregate_context=-(-context * slots // 256) * 256,
        slots=slots,
        cache_type=cache,  # type: ignore[arg-type]
        flash_attn="auto" if cache == "f16" else "on",
        devices=[synthetic_cpu(10**6)],
    )
    return result.devices[0].total_mib + target + 4 + 1


async def assert_load_matches_estimate(
    binary: Path, model: Path, shape: ModelShape, log: Path, *, ctx: int, slots: int, flash_attn: str, cache: str
) -> MemoryEstimate:
    """Load `model` once at this sizing and check the estimate against what the server logged; return it."""
    await load_once(binary, model, log, ctx=ctx, slots=slots, flash_attn=flash_attn, cache=cache)
    result = estimate(
        shape,
        aggregate_context=ctx,
        slots=slots,
        cache_type=cache,  # type: ignore[arg-type]
        flash_attn=flash_attn,  # type: ignore[arg-type]
        devices=[synthetic_cpu(10**6)],
    )
    assert_estimate_matches_log(result, log)
    return result
