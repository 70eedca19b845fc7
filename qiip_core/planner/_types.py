"""Names, limits, records and protocols the whole planner shares.

The limits are llama.cpp's or the seed contract's (`llamacpp_runtime`), not choices of ours; each constant
says where it comes from.

`ModelMetadata` and `TensorMetadata` say what the planner reads from a model file. The llama.cpp engine's GGUF
reader (`qiip_core.engines.llamacpp.read_gguf_metadata`) provides them; the planner names only these protocols,
so it never imports the engine that uses it (the engine imports the planner, never the reverse).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

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
    "ModelMetadata",
    "TensorMetadata",
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


class TensorMetadata(Protocol):
    """One tensor of a model file, as `ModelShape.from_metadata` reads it (`GgufTensor` provides it)."""

    @property
    def name(self) -> str:
        """`blk.3.ffn_up.weight`, `token_embd.weight`, …"""
        ...

    @property
    def ggml_type(self) -> str:
        """The ggml type name in upper case: `F16`, `Q4_K`, `Q8_0`, …"""
        ...

    @property
    def ne(self) -> tuple[int, ...]:
        """Elements per dimension, innermost first (ggml's `ne`)."""
        ...

    @property
    def n_bytes(self) -> int:
        """Bytes of its data."""
        ...

    @property
    def shard(self) -> int:
        """Which file of a split family holds it (0 for the first, or only, file)."""
        ...

    @property
    def offset(self) -> int | None:
        """Where its data starts in that file, in bytes; None when unknown."""
        ...


class ModelMetadata(Protocol):
    """What `ModelShape.from_metadata` reads from a model file (`GgufMetadata` provides it).

    The attributes are the common shape keys every decoder has; `value` and `layer_values` reach every other
    metadata key, `{arch}` standing for the architecture.
    """

    @property
    def architecture(self) -> str:
        """`general.architecture`, such as `llama` or `gemma3`."""
        ...

    @property
    def n_layers(self) -> int:
        """`<arch>.block_count`."""
        ...

    @property
    def n_embd(self) -> int:
        """`<arch>.embedding_length`."""
        ...

    @property
    def n_head(self) -> int:
        """`<arch>.attention.head_count` (the largest, when it varies by layer)."""
        ...

    @property
    def n_head_kv(self) -> int:
        """`<arch>.attention.head_count_kv` (the largest, when it varies by layer)."""
        ...

    @property
    def n_ctx_train(self) -> int:
        """The training context in tokens."""
        ...

    @property
    def n_vocab(self) -> int:
        """Tokens in the vocabulary."""
        ...

    @property
    def head_dim_k(self) -> int:
        """Per-head K width."""
        ...

    @property
    def head_dim_v(self) -> int:
        """Per-head V width."""
        ...

    @property
    def n_ff(self) -> int | None:
        """The feed-forward width (the largest, when it varies by layer); None when absent."""
        ...

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data across all shards."""
        ...

    @property
    def block_tensor_bytes(self) -> tuple[int, ...]:
        """Bytes of the `blk.N.*` tensors of each block, in block order."""
        ...

    @property
    def token_embd_bytes(self) -> int:
        """Bytes of `token_embd.weight`, the input embedding."""
        ...

    @property
    def has_output_weight(self) -> bool:
        """Whether `output.weight` exists; without it the output projection reuses `token_embd.weight`."""
        ...

    @property
    def tensors(self) -> Sequence[TensorMetadata]:
        """Every tensor across all shards, in file order."""
        ...

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value, or `default` when the key is absent; `{arch}` in `key` stands for the architecture."""
        ...

    def layer_values(self, key: str, default: int) -> tuple[int, ...]:
        """A per-layer integer key as one value per block; `default` for every block when the key is absent.

        Raises:
            ModelFileError: an array whose length is not the block count.
        """
        ...
