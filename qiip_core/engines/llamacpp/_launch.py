"""From a plan to a launch: the `llama-server` flags that run exactly what the sizing planner decided.

The planner (`qiip_core.planner`) decides and launches nothing; this engine owns how a decision becomes a
command line. The arrow points one way: the engine imports the planner, never the reverse, so the plan is only
a type here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qiip_core.engines.llamacpp._server import LaunchSpec

if TYPE_CHECKING:
    from qiip_core.planner import Plan

__all__ = ["launch_spec_for"]


def launch_spec_for(
    plan: Plan,
    *,
    model_path: Path,
    alias: str,
    host: str = "127.0.0.1",
    port: int = 0,
    threads: int | None = None,
    embeddings: bool = False,
) -> LaunchSpec:
    """The `llama-server` launch that runs `plan`, every sizing flag spelled out.

    `--ctx-size` is the aggregate, `--parallel` the slots, `--kv-unified`, both cache types, `--flash-attn`,
    `--gpu-layers` (all layers in GPU mode, 0 in CPU mode), `--fit off`, `--log-verbosity 4` (the log lines
    `verify_runtime` reads) and `--metrics`.

    Args:
        plan: the plan.
        model_path: the GGUF file, or the first shard of a split family.
        alias: the model name clients send (`--alias`).
        host: the address to listen on.
        port: the TCP port; 0 lets `LlamaServerProcess.start` pick a free one.
        threads: CPU threads (`--threads`); None lets llama.cpp choose.
        embeddings: serve embeddings (`--embeddings`); plan with `PythonEstimator(embeddings=True)`. An estimate
            made for embeddings (an encoder's always is) launches them whatever this says, with the pooling
            and micro-batch it assumed (`MemoryEstimate.pooling`, `.ubatch_size`); otherwise mean pooling.

    Returns:
        The launch spec.
    """
    return LaunchSpec(
        model=model_path,
        alias=alias,
        host=host,
        port=port,
        ctx_size=plan.aggregate_context,
        slots=plan.slots,
        kv_unified=True,
        cache_type_k=plan.cache_type_k,
        cache_type_v=plan.cache_type_v,
        flash_attn=plan.flash_attn,
        gpu_layers=0 if plan.cpu_mode else "all",
        metrics=True,
        embeddings=embeddings or plan.estimate.pooling is not None,
        pooling=plan.estimate.pooling or "mean",
        ubatch_size=plan.estimate.ubatch_size,
        threads=threads,
        log_verbosity=4,
    )
