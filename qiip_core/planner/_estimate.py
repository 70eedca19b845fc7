"""Memory estimates per device, and the estimators the planner asks.

An estimate splits what llama-server will hold on each device into the three parts `llama-fit-params`
prints: model (weights), context (every cache) and compute (the graph allocator's buffer), plus the output
buffer in host memory. `estimate` computes them from the model's shape alone:

- **model**: in CPU mode every tensor, on the one device. With GPUs the blocks go where llama.cpp puts them by
  default (`layer_split`: proportional to free memory), the output layer on the last device, and the input
  embedding stays in host memory.
  In CPU mode the CPU backend also keeps an interleaved copy of the weights it repacks (`CPU_REPACK`).
- **context**: every cache llama.cpp builds for the architecture (`_memory.memory_layout`: the K/V cache, the
  sliding-window cache, recurrent state), each layer's share on its layer's device. Exact.
- **compute**: the graph `sched_reserve` reserves, rebuilt for the architecture (`_compute.py`) and replayed
  through ggml's allocator (`_galloc.py`). Exact on one device; with several GPUs the scheduler's copies
  between devices are modelled from its source.

Only modelled architectures (`_compute.is_modelled`) can be estimated here; `estimate` refuses the others with a
`PlanError`, and the planner asks `llama-fit-params` instead.

Two estimators answer the planner through one protocol: `PythonEstimator` (these formulas: exact for the
architectures it models, the console's preview) and `FitParamsEstimator` (`llama-fit-params`: llama.cpp
measuring itself, the authority for every architecture we do not model).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from qiip_core._errors import PlanError
from qiip_core.planner._arch import Pooling
from qiip_core.planner._compute import build_graph, is_modelled
from qiip_core.planner._embeddings import embeddings_ubatch, output_buffer_bytes, output_rows
from qiip_core.planner._galloc import compute_buffer_bytes
from qiip_core.planner._graph import GraphParams
from qiip_core.planner._memory import Cache, memory_layout
from qiip_core.planner._shape import ModelShape, WeightMatrix
from qiip_core.planner._types import MIB, CacheType, DeviceMemory, FlashAttn

__all__ = [
    "CUDA_FLASH_ATTN_HEAD_SIZES",
    "DeviceEstimate",
    "Estimator",
    "MemoryEstimate",
    "PythonEstimator",
    "estimate",
    "layer_split",
    "mapped_bytes",
    "repacked_bytes",
    "resolves_flash_attn",
]

CUDA_FLASH_ATTN_HEAD_SIZES = frozenset({40, 64, 72, 80, 96, 112, 128, 192, 256, 320, 512, 576})
"""K head widths llama.cpp's CUDA flash-attention kernels handle (`ggml_cuda_flash_attn_ext_supported`)."""

CPU_ALIGNMENT = 32
"""Alignment of CPU and pinned host buffers in bytes (`TENSOR_ALIGNMENT`)."""

CUDA_ALIGNMENT = 128
"""Alignment of CUDA buffers in bytes (`ggml_backend_cuda_buffer_type_get_alignment`)."""


@dataclass(frozen=True, kw_only=True)
class DeviceEstimate:
    """What one device holds, in MiB (2^20 bytes)."""

    index: int
    """The device's index (`DeviceMemory.index`); -1 for host memory in GPU mode."""
    model_mib: float
    """Weights (`load_tensors: … model buffer size`; in CPU mode `CPU_Mapped` plus `CPU_REPACK`)."""
    context_mib: float
    """Every cache (`llama_kv_cache: size = …` per K/V cache, `llama_memory_recurrent: size = …`)."""
    compute_mib: float
    """Graph allocator buffer (`sched_reserve: … compute buffer size`)."""
    output_mib: float = 0.0
    """Logits (and embeddings) output buffer in host memory at its largest: one row per slot, or with
    embeddings one per token of the batch (`_embeddings.output_rows`); CPU mode and host only."""
    output_at_start_mib: float = 0.0
    """The output buffer as allocated at start, one row per slot: what the log prints (`output buffer size`);
    with embeddings it grows to `output_mib` with the first batch."""

    @property
    def total_mib(self) -> float:
        """Everything the device holds for this server, in MiB."""
        return self.model_mib + self.context_mib + self.compute_mib + self.output_mib

    def record(self) -> dict[str, float | int]:
        """A JSON-ready dict, MiB rounded to 0.01."""
        return {
            "index": self.index,
            "model_mib": round(self.model_mib, 2),
            "context_mib": round(self.context_mib, 2),
            "compute_mib": round(self.compute_mib, 2),
            "output_mib": round(self.output_mib, 2),
        }


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """An estimate for one candidate sizing, per device."""

    devices: tuple[DeviceEstimate, ...]
    """One per planned device, in the order given."""
    host: DeviceEstimate | None = None
    """GPU mode: what stays in host memory (input embedding, inputs, output buffer); None in CPU mode."""
    source: str = "python"
    """Who estimated: `python` or `llama-fit-params`."""
    flash_attn: bool = True
    """Whether the estimate assumed flash attention runs."""
    caches: tuple[Cache, ...] = ()
    """The caches llama.cpp builds for this sizing (`_memory.memory_layout`); empty when unknown."""
    pooling: Pooling | None = None
    """With embeddings, the pooling the estimate assumed (`ModelShape.embeddings_pooling`), which the launch
    must pass (`--pooling`); None for a generative estimate."""
    ubatch_size: int | None = None
    """With embeddings, the micro-batch the estimate assumed (`_embeddings.embeddings_ubatch`), which the
    launch must pass (`--ubatch-size`, `--batch-size`); None for llama-server's defaults."""


class Estimator(Protocol):
    """Estimates the memory of one candidate sizing. The planner calls it for every candidate it tries."""

    @property
    def name(self) -> str:
        """`python` or `llama-fit-params`, recorded with the plan."""
        ...

    def estimate(
        self,
        shape: ModelShape,
        *,
        aggregate_context: int,
        slots: int,
        cache_type: CacheType,
        flash_attn: FlashAttn,
        devices: Sequence[DeviceMemory],
    ) -> MemoryEstimate:
        """Estimate one candidate.

        Args:
            shape: the model.
            aggregate_context: K/V cells in tokens (`--ctx-size`).
            slots: parallel sequences (`--parallel`).
            cache_type: K and V cache type.
            flash_attn: `--flash-attn`.
            devices: the devices, all NVIDIA GPUs or the one CPU device.

        Returns:
            The estimate, one entry per device in order.

        Raises:
            PlanError: the estimate cannot be made (the estimator's program failed or printed nonsense).
        """
        ...


def _f32(x: float) -> float:
    # llama.cpp computes the split in single precision; match its rounding at the boundaries.
    return float(struct.unpack("f", struct.pack("f", x))[0])


def layer_split(free_mib: Sequence[float], total_layers: int) -> tuple[int, ...]:
    """Which device each layer goes to, as llama.cpp splits layers over GPUs by default.

    Without `--tensor-split`, `llama_model::load_tensors` takes each device's free memory, makes running
    shares of it the split points, and puts layer `il` on the first device whose split point exceeds
    `il / total_layers`. The output layer is the last layer.

    Args:
        free_mib: free memory of each device in MiB, in device order.
        total_layers: blocks plus the output layer.

    Returns:
        The position (0-based, in `free_mib` order) of each layer's device, the output layer last.
    """
    if not free_mib:
        raise ValueError("layer_split needs at least one device.")
    weights = [float(f) for f in free_mib] if sum(free_mib) > 0 else [1.0] * len(free_mib)
    points, running = [], 0.0
    for weight in weights:
        running = _f32(running + weight)
        points.append(running)
    points = [_f32(p / running) for p in points]
    last = len(points) - 1
    return tuple(
        next((i for i, p in enumerate(points) if p > _f32(il / total_layers)), last) for il in range(total_layers)
    )


def resolves_flash_attn(shape: ModelShape, flash_attn: FlashAttn, *, cpu: bool) -> bool:
    """Whether flash attention will run for `--flash-attn flash_attn`.

    `on` and `off` are what they say. `auto` is resolved by llama.cpp at start-up (`resolve_fused_ops`): it is
    enabled when every layer's device runs the op, which the CPU always does and CUDA does for its kernels'
    head widths. Where that is unsure the estimate assumes it is off, the larger compute buffer.

    Args:
        shape: the model.
        flash_attn: the requested mode.
        cpu: CPU mode (no GPU).

    Returns:
        True when flash attention is expected to run.
    """
    if flash_attn != "auto":
        return flash_attn == "on"
    return cpu or (shape.head_dim_k == shape.head_dim_v and shape.head_dim_k in CUDA_FLASH_ATTN_HEAD_SIZES)


def estimate(
    shape: ModelShape,
    *,
    aggregate_context: int,
    slots: int,
    cache_type: CacheType,
    flash_attn: FlashAttn,
    n_ubatch: int = 512,
    devices: Sequence[DeviceMemory],
    embeddings: bool = False,
) -> MemoryEstimate:
    """Estimate what llama-server will hold on each device for one sizing, from the model's shape alone.

    Args:
        shape: the model.
        aggregate_context: K/V cells in tokens (`--ctx-size`), a multiple of 256.
        slots: parallel sequences (`--parallel`), sharing one unified K/V pool (`--kv-unified`).
        cache_type: K and V cache type (`--cache-type-k/-v`).
        flash_attn: `--flash-attn`; `auto` is resolved as `resolves_flash_attn` says.
        n_ubatch: micro-batch size in tokens (`--ubatch-size`; llama-server's default is 512).
        devices: the NVIDIA GPUs, or the one CPU device (`kind="cpu"`).
        embeddings: the server runs with `--embeddings`, pooling as `ModelShape.embeddings_pooling` says and
            the micro-batch of `_embeddings.embeddings_ubatch`. Always so for an encoder (a model without
            memory), which llama-server serves nothing else from.

    Returns:
        Model, context and compute MiB per device, in the order of `devices`.

    Raises:
        ValueError: no devices, a CPU device mixed with GPUs, a context that is not a positive multiple of
            256 or smaller than the slots, a Q8_0 cache without flash attention or with head widths that
            are not multiples of 32.
        PlanError: the architecture is not modelled (`_compute.is_modelled`).
    """
    if not devices:
        raise ValueError("estimate needs at least one device.")
    cpu = devices[0].kind == "cpu"
    if cpu and len(devices) != 1 or not cpu and any(d.kind == "cpu" for d in devices):
        raise ValueError("CPU mode plans exactly one CPU device; it is never mixed with GPUs.")
    if aggregate_context < 256 or aggregate_context % 256 or aggregate_context < slots or slots < 1:
        raise ValueError(
            f"aggregate_context must be a positive multiple of 256 tokens and at least slots; got "
            f"{aggregate_context} tokens for {slots} slots."
        )
    if not is_modelled(shape):
        raise PlanError(
            f"The memory of architecture {shape.architecture!r} is not modelled by the Python estimator; install "
            "llama-fit-params next to llama-server (qiip engine install llama.cpp) to plan it."
        )
    embeddings = embeddings or shape.memory == "none"
    if embeddings:
        n_ubatch = embeddings_ubatch(shape, aggregate_context=aggregate_context, slots=slots, n_ubatch=n_ubatch)
    fa = resolves_flash_attn(shape, flash_attn, cpu=cpu)
    if cache_type != "f16" and not fa:
        raise ValueError("a quantised V cache needs flash attention (llama.cpp refuses it otherwise).")
    caches = memory_layout(
        shape, aggregate_context=aggregate_context, slots=slots, cache_type=cache_type, n_ubatch=n_ubatch, flash_attn=fa
    )
    swa_cells = next((c.cells for c in caches if c.kind == "kv_swa"), 0)
    output_bytes = output_buffer_bytes(
        shape, rows=output_rows(slots=slots, ubatch=n_ubatch, embeddings=embeddings), embeddings=embeddings
    )
    output_at_start = output_buffer_bytes(shape, rows=slots, embeddings=embeddings) / MIB
    # What the launch must pass for the server to be the one estimated.
    pooling = shape.embeddings_pooling if embeddings else None
    ubatch_size = n_ubatch if embeddings else None
    if cpu:
        params = GraphParams(
            aggregate_context=aggregate_context,
            slots=slots,
            cache_type=cache_type,
            flash_attn=fa,
            n_ubatch=n_ubatch,
            embeddings=embeddings,
            swa_cells=swa_cells,
        )
        buffer = _compute_buffers(shape, params, CPU_ALIGNMENT, keep_copies=False)[0]
        only = DeviceEstimate(
            index=devices[0].index,
            model_mib=(mapped_bytes(shape, devices[0]) + repacked_bytes(shape, devices[0])) / MIB,
            context_mib=sum(c.bytes for c in caches) / MIB,
            compute_mib=buffer / MIB,
            output_mib=output_bytes / MIB,
            output_at_start_mib=output_at_start,
        )
        return MemoryEstimate(
            devices=(only,),
            source="python",
            flash_attn=fa,
            caches=caches,
            pooling=pooling,
            ubatch_size=ubatch_size,
        )

    host = len(devices)
    split = layer_split([d.free_mib for d in devices], shape.total_layers)
    params = GraphParams(
        aggregate_context=aggregate_context,
        slots=slots,
        cache_type=cache_type,
        flash_attn=fa,
        n_ubatch=n_ubatch,
        embeddings=embeddings,
        layer_devices=split,
        host=host,
        swa_cells=swa_cells,
    )
    # Several GPUs run as a pipeline (`pipeline parallelism enabled`), whose copies between devices stay.
    compute = _compute_buffers(shape, params, CUDA_ALIGNMENT, keep_copies=len(devices) > 1)
    layer_bytes = shape.layer_bytes()
    per_device = []
    for position, device in enumerate(devices):
        blocks = [il for il in range(shape.n_layers) if split[il] == position]
        model = sum(layer_bytes[il] for il in blocks) + (shape.output_bytes() if split[-1] == position else 0)
        per_device.append(
            DeviceEstimate(
                index=device.index,
                model_mib=model / MIB,
                context_mib=sum(c.layer_bytes(il) for c in caches for il in blocks) / MIB,
                compute_mib=compute.get(position, 0) / MIB,
            )
        )
    host_estimate = DeviceEstimate(
        index=-1,
        model_mib=shape.token_embd_bytes / MIB,
        context_mib=0.0,
        compute_mib=compute.get(host, 0) / MIB,
        output_mib=output_bytes / MIB,
        output_at_start_mib=output_at_start,
    )
    return MemoryEstimate(
        devices=tuple(per_device),
        host=host_estimate,
        source="python",
        flash_attn=fa,
        caches=caches,
        pooling=pooling,
        ubatch_size=ubatch_size,
    )


@functools.lru_cache(maxsize=512)
def _compute_buffers(shape: ModelShape, params: GraphParams, alignment: int, *, keep_copies: bool) -> dict[int, int]:
    """The compute buffer of each device, in bytes: the graph of `shape` under `params`, replayed through the
    allocator with `alignment` on the devices and CPU alignment on the host (`params.host`).

    The costliest step of an estimate, and a function of these inputs alone: free memory reaches it only through
    `params.layer_devices`, so hosts whose GPUs split the layers alike (eight GPUs of equal free memory, whatever
    their product) and every candidate of a search that shares a graph replay it once. The arguments are frozen
    values compared whole; callers read the result and never change it.
    """
    aligned = dict.fromkeys(set(params.layer_devices), alignment) | {params.host: CPU_ALIGNMENT}
    return compute_buffer_bytes(build_graph(shape, params), alignment=aligned, keep_copies=keep_copies)


def repacked_bytes(shape: ModelShape, device: DeviceMemory) -> int:
    """Bytes of the weights the CPU backend keeps a repacked copy of (`CPU_REPACK model buffer size`).

    A matrix is repacked when its type is one `device.repack` lists and its rows are a whole number of the
    interleaved groups. With a tied output the embedding is read by a matrix multiplication too.

    Args:
        shape: the model (its `weight_matrices`).
        device: the CPU device (`read_cpu_repack` filled its `repack`); GPUs repack nothing.
    """
    return sum(m.n_bytes for m in _repacked(shape, device))


def _repacked(shape: ModelShape, device: DeviceMemory) -> list[WeightMatrix]:
    rules = dict(device.repack)
    if device.kind != "cpu" or not rules:
        return []
    return [m for m in shape.weight_matrices if m.ggml_type in rules and m.rows % rules[m.ggml_type] == 0]


def mapped_bytes(shape: ModelShape, device: DeviceMemory) -> int:
    """Bytes of the model files CPU mode maps (`CPU_Mapped model buffer size`, summed over the files).

    llama.cpp maps, per file, the range from the first to the last tensor its CPU buffer holds
    (`llama_model_loader::get_mapping_range`), padding between tensors included. Weights the CPU backend repacks
    live in `CPU_REPACK` instead, so repacked weights at either end of a file (the experts of the last block,
    in a file sorted by name) are not mapped.

    Args:
        shape: the model (its `stored_tensors`; without them, every tensor's bytes).
        device: the CPU device (what it repacks, `repacked_bytes`).
    """
    if not shape.stored_tensors:
        return shape.weights_bytes
    repacked = {m.name for m in _repacked(shape, device)}
    total = 0
    for shard in sorted({t.shard for t in shape.stored_tensors}):
        kept = [t for t in shape.stored_tensors if t.shard == shard and t.name not in repacked]
        if kept:
            total += max(t.offset + t.n_bytes for t in kept) - min(t.offset for t in kept)
    return total


@dataclass(frozen=True, kw_only=True)
class PythonEstimator:
    """`estimate` behind the `Estimator` protocol: no program to run, exact on one device."""

    n_ubatch: int = 512
    """Micro-batch size in tokens (`--ubatch-size`)."""
    embeddings: bool = False
    """Plan for `--embeddings` (the model's own pooling, else mean; see `estimate`)."""

    @property
    def name(self) -> str:
        """`python`."""
        return "python"

    def estimate(
        self,
        shape: ModelShape,
        *,
        aggregate_context: int,
        slots: int,
        cache_type: CacheType,
        flash_attn: FlashAttn,
        devices: Sequence[DeviceMemory],
    ) -> MemoryEstimate:
        """See `Estimator.estimate`; raises ValueError as `estimate` does."""
        return estimate(
            shape,
            aggregate_context=aggregate_context,
            slots=slots,
            cache_type=cache_type,
            flash_attn=flash_attn,
            n_ubatch=self.n_ubatch,
            devices=devices,
            embeddings=self.embeddings,
        )
