"""Names, limits and records the whole planner shares.

The limits are llama.cpp's or the seed contract's (`llamacpp_runtime`), not choices of ours; each constant
says where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "CONTEXT_FLOOR",
    "CONTEXT_STEP",
    "FIT_SLACK_MIB",
    "MAX_AGGREGATE_CONTEXT",
    "MAX_SLOTS",
    "MIB",
    "CacheType",
    "DeviceKind",
    "DeviceMemory",
    "FlashAttn",
    "ceil_step",
]

CacheType = Literal["f16", "q8_0"]
"""K/V cache element types the planner uses (`--cache-type-k/-v`); it never goes below `q8_0`."""

FlashAttn = Literal["auto", "on", "off"]
"""`--flash-attn`: the planner asks for `auto` with F16 K/V and `on` with Q8_0 (a quantised V cache needs it)."""

DeviceKind = Literal["nvidia", "cpu"]
"""An NVIDIA GPU read through NVML, or the host CPU planned against system memory (CPU mode)."""

MIB = 1024 * 1024
"""Bytes in a MiB; llama.cpp logs and `llama-fit-params` print MiB."""

CONTEXT_STEP = 256
"""Contexts are multiples of 256 tokens: llama.cpp pads `n_ctx` to 256 (`GGML_PAD(n_ctx, 256)` in
`llama_context`), and the seed's custom contexts are 256-aligned."""

CONTEXT_FLOOR = 4096
"""The automatic policy never guarantees less than `min(4096, training context)` tokens per slot (seed)."""

MAX_SLOTS = 256
"""The most parallel sequences (`--parallel`) the planner gives one server (seed `effective.slots ≤ 256`)."""

MAX_AGGREGATE_CONTEXT = 4_294_967_040
"""The largest `--ctx-size`: 2^32 − 256, the largest 256-aligned value of llama.cpp's `uint32_t n_ctx`."""

FIT_SLACK_MIB = 4
"""Extra MiB a candidate must leave free on every device beyond the fit target (the seed's `+ 4`)."""


def ceil_step(tokens: int, step: int = CONTEXT_STEP) -> int:
    """Round a token count up to a multiple of `step`.

    Args:
        tokens: a count of tokens, at least 0.
        step: the multiple, in tokens.

    Returns:
        The smallest multiple of `step` that is at least `tokens`.
    """
    return -(-tokens // step) * step


@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    """One device the planner places a model on, and its memory.

    In GPU mode there is one per NVIDIA GPU, in NVML index order (the order llama.cpp's CUDA backend numbers
    them, `CUDA0`, `CUDA1`, …). In CPU mode there is exactly one, `kind="cpu"`, whose memory is the host's.
    """

    index: int
    """NVML device index (`CUDA<index>` in llama.cpp's logs); 0 for the CPU device."""
    name: str
    """The product name (`NVIDIA A100-SXM4-80GB`) or `CPU (system memory)`."""
    total_mib: int
    """Total memory in MiB (NVML `memory.total`; `MemTotal` in CPU mode)."""
    free_mib: int
    """Memory available to a new process in MiB (NVML `memory.free`; `MemAvailable` in CPU mode)."""
    kind: DeviceKind = "nvidia"
    """`nvidia` for a GPU; `cpu` for the host in CPU mode, which a managed GPU node never uses."""
    repack: tuple[tuple[str, int], ...] = ()
    """CPU mode: the weight types the CPU backend repacks into its `CPU_REPACK` buffer, each with the row count
    a matrix must be a multiple of (`ggml_repack_get_optimal_repack_type`); `read_cpu_repack` reads them."""

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"index must be at least 0, got {self.index}.")
        if self.total_mib < 0 or not 0 <= self.free_mib <= self.total_mib:
            raise ValueError(
                f"free_mib ({self.free_mib}) must be between 0 and total_mib ({self.total_mib}), both at least 0."
            )

    @property
    def used_mib(self) -> int:
        """Memory in use in MiB: total minus free."""
        return self.total_mib - self.free_mib

    def record(self) -> dict[str, int]:
        """The seed's `llamacpp_runtime.gpus[]` entry: `{index, total_mib, used_mib, free_mib}`."""
        return {"index": self.index, "total_mib": self.total_mib, "used_mib": self.used_mib, "free_mib": self.free_mib}
