"""The shape of a model as the planner sees it, and the exact K/V cache arithmetic.

A `ModelShape` is everything memory depends on: block count, widths, head counts and sizes, feed-forward width,
vocabulary, training context and where the weight bytes sit (per block, input embedding, output). It comes from
`read_gguf_metadata` (`ModelShape.from_metadata`) or is written by hand in tests.

The K/V cache is exact arithmetic over llama.cpp's layout (`llama_kv_cache`): per layer one K tensor of
`n_head_kv * head_dim_k` elements per cell and one V tensor of `n_head_kv * head_dim_v`, stored as F16 (2 bytes
per element) or Q8_0 (blocks of 32 elements in 34 bytes: 32 int8 values and one F16 scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from qiip_core.planner._types import MIB, CacheType

if TYPE_CHECKING:
    from qiip_core.engines.llamacpp import GgufMetadata

__all__ = ["ModelShape", "kv_bytes_per_token", "row_bytes"]

_TYPE_LAYOUT: dict[str, tuple[int, int]] = {
    "f32": (4, 1),
    "f16": (2, 1),
    "i32": (4, 1),
    "i64": (8, 1),
    "q8_0": (34, 32),
}
"""ggml type → (bytes per block, elements per block), as `ggml_type_size` / `ggml_blck_size` give them."""

Q8_0_BLOCK = 32
"""Elements per Q8_0 block (`QK8_0`); a quantised row must be a whole number of blocks."""


def row_bytes(dtype: str, elements: int) -> int:
    """Bytes of a row of `elements` values of a ggml type (`ggml_row_size`).

    Args:
        dtype: `f32`, `f16`, `i32`, `i64` or `q8_0`.
        elements: values in the row; a multiple of 32 for `q8_0`.

    Returns:
        The row's size in bytes.

    Raises:
        ValueError: an unknown type, or a Q8_0 row that is not a whole number of blocks.
    """
    try:
        block_bytes, block = _TYPE_LAYOUT[dtype]
    except KeyError:
        raise ValueError(f"unknown ggml type {dtype!r}; expected one of {sorted(_TYPE_LAYOUT)}.") from None
    if elements % block:
        raise ValueError(f"a {dtype} row holds whole blocks of {block} values; {elements} is not a multiple.")
    return elements // block * block_bytes


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the memory of a llama-style model depends on.

    Widths are element counts, sizes are bytes, contexts are tokens.
    """

    architecture: str
    """`general.architecture`; the compute estimate models llama's graph, which llama-style decoders share."""
    n_layers: int
    """Transformer blocks (`<arch>.block_count`)."""
    n_embd: int
    """Embedding width (`<arch>.embedding_length`)."""
    n_head: int
    """Query heads (`<arch>.attention.head_count`)."""
    n_head_kv: int
    """K/V heads (`<arch>.attention.head_count_kv`); fewer than `n_head` with grouped-query attention."""
    head_dim_k: int
    """Width of one K head (`<arch>.attention.key_length`, else `n_embd / n_head`)."""
    head_dim_v: int
    """Width of one V head (`<arch>.attention.value_length`, else `n_embd / n_head`)."""
    n_ff: int
    """Feed-forward width (`<arch>.feed_forward_length`)."""
    n_ctx_train: int
    """Training context in tokens (`<arch>.context_length`)."""
    n_vocab: int
    """Vocabulary size: the rows of the output logits."""
    weights_bytes: int
    """Bytes of all tensors (the model buffer in CPU mode)."""
    block_bytes: tuple[int, ...] = ()
    """Bytes of each block's tensors, in block order; empty means an even share of what is not embedding."""
    token_embd_bytes: int = 0
    """Bytes of the input embedding, which llama.cpp keeps on the host in GPU mode."""
    tied_output: bool = False
    """The output projection reuses the input embedding; llama.cpp then copies it to the output device."""

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_embd", "n_head", "n_head_kv", "head_dim_k", "head_dim_v", "n_ff", "n_vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.n_ctx_train < 1:
            raise ValueError(f"n_ctx_train must be at least 1 token, got {self.n_ctx_train}.")
        if self.block_bytes and len(self.block_bytes) != self.n_layers:
            raise ValueError(f"block_bytes has {len(self.block_bytes)} entries for {self.n_layers} blocks.")
        if self.weights_bytes < sum(self.block_bytes) + self.token_embd_bytes:
            raise ValueError("weights_bytes must cover block_bytes and token_embd_bytes.")

    @classmethod
    def from_metadata(cls, metadata: GgufMetadata) -> ModelShape:
        """The shape of a GGUF model, from `read_gguf_metadata`.

        Args:
            metadata: the model's metadata.

        Returns:
            Its shape; a missing feed-forward width is taken as `4 * n_embd` (the llama default).
        """
        return cls(
            architecture=metadata.architecture,
            n_layers=metadata.n_layers,
            n_embd=metadata.n_embd,
            n_head=metadata.n_head,
            n_head_kv=metadata.n_head_kv,
            head_dim_k=metadata.head_dim_k,
            head_dim_v=metadata.head_dim_v,
            n_ff=metadata.n_ff if metadata.n_ff is not None else 4 * metadata.n_embd,
            n_ctx_train=metadata.n_ctx_train,
            n_vocab=metadata.n_vocab,
            weights_bytes=metadata.tensor_bytes,
            block_bytes=metadata.block_tensor_bytes,
            token_embd_bytes=metadata.token_embd_bytes,
            tied_output=not metadata.has_output_weight,
        )

    @property
    def total_layers(self) -> int:
        """Layers llama.cpp counts for offload: the blocks plus the output layer (`offloaded L/L layers`)."""
        return self.n_layers + 1

    @property
    def weights_mib(self) -> float:
        """All tensor bytes in MiB."""
        return self.weights_bytes / MIB

    def layer_bytes(self) -> tuple[int, ...]:
        """Bytes of each block: `block_bytes`, or an even share of the non-embedding bytes when unknown."""
        if self.block_bytes:
            return self.block_bytes
        rest = max(0, self.weights_bytes - self.token_embd_bytes - self.output_bytes())
        return tuple(rest // self.n_layers for _ in range(self.n_layers))

    def output_bytes(self) -> int:
        """Bytes of the output layer (output norm and projection) on the device that runs it.

        With a tied output the projection is a copy of the input embedding (`TENSOR_DUPLICATED` in
        `llama_model::load_tensors`), so it weighs what the embedding weighs.
        """
        if not self.block_bytes:
            # Unknown split: the output projection is n_vocab x n_embd, like the embedding.
            return self.token_embd_bytes
        rest = self.weights_bytes - sum(self.block_bytes) - self.token_embd_bytes
        return rest + (self.token_embd_bytes if self.tied_output else 0)

    def supports_cache_type(self, cache_type: CacheType) -> bool:
        """Whether llama.cpp can store this model's K/V heads as `cache_type`.

        Q8_0 stores whole 32-element blocks, and the cache is viewed per head, so both head widths must be
        multiples of 32.
        """
        if cache_type == "q8_0":
            return self.head_dim_k % Q8_0_BLOCK == 0 and self.head_dim_v % Q8_0_BLOCK == 0
        return True


def kv_bytes_per_token(shape: ModelShape, cache_type: CacheType) -> int:
    """Exact K/V cache bytes per cell (token) over all layers.

    This is llama.cpp's `llama_kv_cache` layout: per layer, `ggml_row_size(type_k, n_head_kv * head_dim_k)` +
    `ggml_row_size(type_v, n_head_kv * head_dim_v)`. Multiply by `--ctx-size` for the size the server logs in
    `llama_kv_cache: size = … MiB (N cells, …)`.

    Args:
        shape: the model.
        cache_type: `f16` (2 bytes per element) or `q8_0` (34 bytes per 32 elements).

    Returns:
        Bytes per token of context.

    Raises:
        ValueError: Q8_0 with a head width that is not a multiple of 32.
    """
    if not shape.supports_cache_type(cache_type):
        raise ValueError(
            f"a {cache_type} K/V cache needs head widths that are multiples of {Q8_0_BLOCK}; this model has "
            f"K {shape.head_dim_k} and V {shape.head_dim_v}."
        )
    k = row_bytes(cache_type, shape.n_head_kv * shape.head_dim_k)
    v = row_bytes(cache_type, shape.n_head_kv * shape.head_dim_v)
    return shape.n_layers * (k + v)
