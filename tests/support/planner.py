"""The planner's tests on real llama-server processes: generated models, plans launched and verified, and what
the servers log compared with the estimates."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from qiip_core.engines.llamacpp import (
    LaunchSpec,
    LlamaServerProcess,
    launch_spec_for,
    make_test_gguf,
    read_gguf_metadata,
)
from qiip_core.nodes import LlamaCppRuntime
from qiip_core.planner import (
    DeviceMemory,
    MemoryEstimate,
    ModelShape,
    Plan,
    estimate,
    parse_server_log,
    read_devices,
    verify_runtime,
)
from tests.support.llama_server import running

TOLERANCE = 0.02
"""Estimates must be within 2% of what llama-server logs."""

LOG_ROUNDING_MIB = 0.005 + 1e-9
"""llama-server prints MiB with two decimals: a tiny buffer may differ from its figure by half a hundredth."""

ModelRow = tuple[str, int, int, int, int, int, int, int, Mapping[str, int | float | bool]]
"""A generated model: (architecture, blocks, width, heads, K/V heads, training context, vocabulary, FFN width,
the architecture's options)."""


def synthetic_cpu(free_mib: float) -> DeviceMemory:
    """A CPU device with `free_mib` free, for planning; the server itself has the machine's memory."""
    return DeviceMemory(index=0, name="CPU (planned)", total_mib=10**7, free_mib=int(free_mib), kind="cpu")


def generated_model(path: Path, **gguf: Any) -> tuple[Path, ModelShape]:
    """Write a test model with `make_test_gguf(path, **gguf)` and read its shape back from the file."""
    written = make_test_gguf(path, **gguf)[0]
    return written, ModelShape.from_metadata(read_gguf_metadata(written))


def generated_models(directory: Path, rows: Mapping[str, ModelRow]) -> dict[str, tuple[Path, ModelShape]]:
    """One generated model per row, written to `directory/NAME.gguf`, with its shape."""
    return {
        name: generated_model(
            directory / f"{name}.gguf",
            architecture=architecture,
            n_layers=layers,
            n_embd=width,
            n_head=heads,
            n_head_kv=kv_heads,
            n_ctx_train=train,
            n_vocab=vocab,
            n_ff=ff,
            options=options,
        )
        for name, (architecture, layers, width, heads, kv_heads, train, vocab, ff, options) in rows.items()
    }


@contextlib.asynccontextmanager
async def running_plan(
    binary: Path, model: Path, p: Plan, log: Path, *, alias: str = "planned", embeddings: bool = False
) -> AsyncIterator[tuple[LlamaServerProcess, LlamaCppRuntime]]:
    """A llama-server launched as plan `p` says (one thread), its runtime verified against the plan on the way in.

    Yields:
        The running server, and the runtime record `verify_runtime` made of it (the real devices read after).

    Raises:
        VerificationError: the running server differs from the plan.
    """
    spec = launch_spec_for(p, model_path=model, alias=alias, threads=1, embeddings=embeddings)
    async with running(binary, spec, log) as server:
        record = await verify_runtime(
            p, endpoint=server.endpoint, log_path=log, alias=alias, devices_after=read_devices(allow_cpu=True)
        )
        yield server, record


async def launch_and_verify(
    binary: Path, model: Path, p: Plan, log: Path, *, embeddings: bool = False
) -> LlamaCppRuntime:
    """Run plan `p` once: its record must be the plan's (in CPU mode) and its estimate must match the log.

    Returns:
        The runtime record of the server, stopped by now.
    """
    async with running_plan(binary, model, p, log, embeddings=embeddings) as (_, record):
        pass
    assert record.effective == p.effective() and record.requested == p.requested()
    assert record.effective["device_mode"] == "cpu" and record.effective["gpu_layers"] == 0
    assert_estimate_matches_log(p.estimate, log)
    return record


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
