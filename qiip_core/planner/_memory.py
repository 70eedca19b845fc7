"""The caches llama.cpp builds for one sizing: which layers each holds, how many cells, and their exact bytes.

One server holds up to three caches, decided by the model's memory kind (`_arch.MemoryKind`):

```
kv           "kv"        every attention layer, --ctx-size cells                          llama_kv_cache
iswa         "kv"        full-attention layers, --ctx-size cells                          llama_kv_cache_iswa
             "kv_swa"    sliding-window layers, pad256(min(ctx, window × slots + ubatch)) cells
recurrent    "recurrent" every recurrent layer, max(1, slots) cells of R and S state       llama_memory_recurrent
hybrid       "kv"        the attention layers                                             llama_memory_hybrid
             "recurrent" the recurrent layers
hybrid_iswa  "kv", "kv_swa", "recurrent"                                                  llama_memory_hybrid_iswa
none         nothing: an encoder keeps no state between batches
```

The sizes are llama.cpp's own arithmetic (`llama_kv_cache::llama_kv_cache`, `llama_kv_cache_iswa`,
`llama_memory_recurrent`, `llama_hparams::n_embd_r/n_embd_s`), so each `Cache` equals what the server logs on its
`llama_kv_cache: size = … MiB (N cells, L layers, …)` or `llama_memory_recurrent: size = …` line, to the byte.
With one unified K/V pool (`--kv-unified`) the sliding-window cache holds a window per slot plus a micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qiip_core.planner._shape import ModelShape, row_bytes
from qiip_core.planner._types import MIB, CacheType, ceil_step

__all__ = ["Cache", "CacheKind", "memory_layout", "recurrent_state_widths"]

CacheKind = Literal["kv", "kv_swa", "recurrent"]
"""A full-attention K/V cache, a sliding-window K/V cache, or recurrent state."""

RECURRENT_TYPE = "f32"
"""Recurrent state is stored as F32 (`GGML_TYPE_F32` for both R and S in `create_memory`)."""


@dataclass(frozen=True, kw_only=True)
class Cache:
    """One cache llama.cpp allocates, as it logs it."""

    kind: CacheKind
    """`kv`, `kv_swa` or `recurrent`."""
    cells: int
    """K/V cells (tokens), or recurrent cells (one per sequence)."""
    layers: tuple[int, ...]
    """The blocks whose rows it holds."""
    type_k: str
    """K (or R, for recurrent state) element type: `f16`, `q8_0`, `f32`."""
    type_v: str
    """V (or S) element type."""
    k_bytes: int
    """Bytes of K (or R) over all its layers and cells."""
    v_bytes: int
    """Bytes of V (or S)."""
    layer_sizes: tuple[int, ...] = ()
    """Bytes of each block's share, in the order of `layers` (with several GPUs, each lives on its layer's
    device)."""

    @property
    def bytes(self) -> int:
        """Everything it holds, in bytes."""
        return self.k_bytes + self.v_bytes

    @property
    def mib(self) -> float:
        """Everything it holds, in MiB (what the log prints, to two decimals)."""
        return self.bytes / MIB

    def layer_bytes(self, il: int) -> int:
        """Bytes of block `il`'s share of this cache (0 when the block is not in it)."""
        return self.layer_sizes[self.layers.index(il)] if il in self.layers else 0

    def record(self) -> dict[str, object]:
        """A JSON-ready description: kind, cells, layer count, types and MiB (two decimals)."""
        return {
            "kind": self.kind,
            "cells": self.cells,
            "layers": len(self.layers),
            "type_k": self.type_k,
            "type_v": self.type_v,
            "mib": round(self.mib, 2),
        }


def recurrent_state_widths(shape: ModelShape) -> tuple[int, int]:
    """Elements of R (convolution or token-shift state) and S (scan state) per cell and recurrent layer.

    `llama_hparams::n_embd_r` and `n_embd_s`: LFM2's short convolution keeps `(l_cache - 1) × n_embd` of R and no
    S; Mamba keeps `(d_conv - 1) × (d_inner + 2 × n_group × d_state)` of R and `d_state × d_inner` of S.

    Args:
        shape: the model.

    Returns:
        `(r, s)` element counts; `(0, 0)` for a model without recurrent layers.
    """
    if shape.shortconv_cache:
        return shape.n_embd * (shape.shortconv_cache - 1), 0
    if shape.ssm is None:
        return 0, 0
    ssm = shape.ssm
    r = max(ssm.conv_kernel - 1, 0) * (ssm.inner_size + 2 * ssm.group_count * ssm.state_size)
    return r, ssm.state_size * ssm.inner_size


def swa_cells(shape: ModelShape, *, aggregate_context: int, slots: int, n_ubatch: int) -> int:
    """Cells of the sliding-window cache (`llama_kv_cache_iswa`): `pad256(min(ctx, window × slots + ubatch))`.

    With one unified pool every slot may hold a full window at once, plus the micro-batch being written.
    """
    return ceil_step(min(aggregate_context, shape.swa_window * slots + n_ubatch))


def memory_layout(
    shape: ModelShape,
    *,
    aggregate_context: int,
    slots: int,
    cache_type: CacheType,
    n_ubatch: int = 512,
    flash_attn: bool = True,
) -> tuple[Cache, ...]:
    """The caches llama-server allocates for one sizing, in the order it logs them.

    Args:
        shape: the model (`memory_known` must be True).
        aggregate_context: `--ctx-size` in tokens: the cells of the (full-attention) K/V cache.
        slots: `--parallel`, one unified pool (`--kv-unified`).
        cache_type: `--cache-type-k` and `--cache-type-v`.
        n_ubatch: `--ubatch-size` in tokens (llama-server's default 512); it widens the sliding-window cache.
        flash_attn: whether flash attention runs; without it V is stored transposed, each layer's V rows as wide
            as the widest layer's (`n_embd_v_gqa_max`, `[TAG_V_CACHE_VARIABLE]`).

    Returns:
        The caches; empty for an encoder without memory.

    Raises:
        ValueError: the model's memory rules are unknown, or Q8_0 with heads that are not multiples of 32.
    """
    if not shape.memory_known:
        raise ValueError(f"llama.cpp's memory for architecture {shape.architecture!r} is not modelled.")
    if shape.memory == "none":
        return ()
    caches: list[Cache] = []
    attention = shape.attention_layers() if shape.memory != "recurrent" else ()
    v_width = 0 if flash_attn else max((_v_width(shape, il) for il in range(shape.n_layers)), default=0)
    if shape.memory in ("kv", "hybrid"):
        caches.append(_kv("kv", shape, attention, aggregate_context, cache_type, v_width))
    elif shape.memory in ("iswa", "hybrid_iswa"):
        full = tuple(il for il in attention if not shape.is_swa(il))
        sliding = tuple(il for il in attention if shape.is_swa(il))
        cells = swa_cells(shape, aggregate_context=aggregate_context, slots=slots, n_ubatch=n_ubatch)
        caches.append(_kv("kv", shape, full, aggregate_context, cache_type, v_width))
        caches.append(_kv("kv_swa", shape, sliding, cells, cache_type, v_width))
    if shape.memory in ("recurrent", "hybrid", "hybrid_iswa"):
        layers = tuple(il for il in range(shape.n_layers) if shape.is_recurrent(il))
        r, s = recurrent_state_widths(shape)
        # One cell per sequence (`create_memory`: max(1, n_seq_max)), one row each: rollback snapshots
        # (`n_rs_seq`, 1 + n_rs_seq rows per cell) come only with speculative decoding, never launched here.
        cells = max(1, slots)
        r_bytes, s_bytes = cells * row_bytes(RECURRENT_TYPE, r), cells * row_bytes(RECURRENT_TYPE, s)
        caches.append(
            Cache(
                kind="recurrent",
                cells=cells,
                layers=layers,
                type_k=RECURRENT_TYPE,
                type_v=RECURRENT_TYPE,
                k_bytes=len(layers) * r_bytes,
                v_bytes=len(layers) * s_bytes,
                layer_sizes=(r_bytes + s_bytes,) * len(layers),
            )
        )
    return tuple(caches)


def _v_width(shape: ModelShape, il: int) -> int:
    return shape.layer_kv_heads(il) * shape.layer_head_dims(il)[1]


def _kv(
    kind: CacheKind, shape: ModelShape, layers: tuple[int, ...], cells: int, cache_type: CacheType, v_width: int
) -> Cache:
    """One K/V cache; `v_width` > 0 gives every layer's V that many elements per cell (transposed V)."""
    ks = [row_bytes(cache_type, shape.layer_kv_heads(il) * shape.layer_head_dims(il)[0]) * cells for il in layers]
    vs = [row_bytes(cache_type, v_width or _v_width(shape, il)) * cells for il in layers]
    return Cache(
        kind=kind,
        cells=cells,
        layers=layers,
        type_k=cache_type,
        type_v=cache_type,
        k_bytes=sum(ks),
        v_bytes=sum(vs),
        layer_sizes=tuple(k + v for k, v in zip(ks, vs, strict=True)),
    )
