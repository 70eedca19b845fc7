"""What llama.cpp does with each model architecture: which memory it builds and which layers use which part.

A GGUF names its architecture (`general.architecture`) and stores hyperparameters under `<arch>.*` keys, but the
memory llama.cpp builds from them is decided in code, per architecture (`llama_model::create_memory`, each
model's `load_arch_hparams`):

```
memory kind    what llama.cpp builds                                   architectures (examples)
kv             one K/V cache (llama_kv_cache) for every layer          llama, qwen2, qwen3, qwen3moe, mistral
iswa           a full cache and a sliding-window cache                 gemma2, gemma3, and kv models with a window
               (llama_kv_cache_iswa)
recurrent      one state per sequence (llama_memory_recurrent)         mamba, mamba2, rwkv6, rwkv7
hybrid         a K/V cache for attention layers and a recurrent        lfm2, granitehybrid, jamba, qwen3next
               state for the others (llama_memory_hybrid)
none           no memory at all: an encoder                            bert, nomic-bert
```

`ArchitectureRules` records those decisions for the architectures the planner knows; `rules_for` returns None
for any other, and the planner then treats the model as unmodelled (planned by `llama-fit-params`, verified on
the facts every server logs). The rules here are llama.cpp's, read from its source (`src/models/<arch>.cpp`,
`src/llama-model.cpp`, `src/llama-hparams.cpp`), not choices of ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["POOLING_TYPES", "ArchitectureRules", "MemoryKind", "Pooling", "rules_for", "swa_pattern"]

MemoryKind = Literal["kv", "iswa", "recurrent", "hybrid", "hybrid_iswa", "none"]
"""The memory llama.cpp builds for a model (see the module docstring)."""

Pooling = Literal["none", "mean", "cls", "last", "rank"]
"""How an embedding model pools token vectors into one (`<arch>.pooling_type`, `llama_pooling_type`)."""

POOLING_TYPES: dict[int, Pooling] = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
"""`<arch>.pooling_type` values (`enum llama_pooling_type` in llama.h)."""

RecurrentRule = Literal["none", "all", "no_kv_heads"]
"""Which blocks are recurrent: none, every block, or those whose `head_count_kv` is 0 (`is_recr_impl`)."""

SwaRule = Literal["none", "window_key", "always", "attention_layers"]
"""When sliding-window attention is on: never; when `<arch>.attention.sliding_window` is above 0 (gemma3); always,
with a default window (gemma2); or on every attention layer of a hybrid when the window key is set (lfm2)."""


@dataclass(frozen=True, kw_only=True)
class ArchitectureRules:
    """llama.cpp's decisions for one architecture."""

    base_memory: Literal["kv", "recurrent", "hybrid", "none"]
    """The memory without a sliding window; a window turns `kv` into `iswa` and `hybrid` into `hybrid_iswa`."""
    swa: SwaRule = "none"
    """When the sliding window is on (`SwaRule`)."""
    swa_pattern: int = 0
    """Default layer pattern when the model gives none (`load_swa_pattern(ml, n)`): of every `n` layers, the
    last is full attention and the others slide (0: every layer slides)."""
    swa_default_window: int = 0
    """The window when `<arch>.attention.sliding_window` is absent (gemma2: 4096)."""
    recurrent: RecurrentRule = "none"
    """Which blocks carry recurrent state."""
    causal: bool = True
    """Default of `<arch>.attention.causal`; encoders attend both ways."""


_DENSE = ArchitectureRules(base_memory="kv")

_RULES: dict[str, ArchitectureRules] = {
    # Dense decoders with one K/V cache (llama's graph, with small variations).
    "llama": _DENSE,  # also Mixtral-style experts: `llama.expert_count`
    "qwen2": _DENSE,
    "qwen3": _DENSE,
    # Mixtures of experts: the same cache, expert feed-forward blocks.
    "qwen2moe": _DENSE,
    "qwen3moe": _DENSE,
    # Interleaved sliding-window attention.
    "gemma2": ArchitectureRules(base_memory="kv", swa="always", swa_pattern=2, swa_default_window=4096),
    "gemma3": ArchitectureRules(base_memory="kv", swa="window_key", swa_pattern=6),
    # Recurrent and hybrid models.
    "mamba": ArchitectureRules(base_memory="recurrent", recurrent="all"),
    "mamba2": ArchitectureRules(base_memory="recurrent", recurrent="all"),
    "lfm2": ArchitectureRules(base_memory="hybrid", recurrent="no_kv_heads", swa="attention_layers"),
    "granitehybrid": ArchitectureRules(base_memory="hybrid", recurrent="no_kv_heads"),
    # Encoders: no memory.
    "bert": ArchitectureRules(base_memory="none", causal=False),
    "nomic-bert": ArchitectureRules(base_memory="none", causal=False),
}


def rules_for(architecture: str) -> ArchitectureRules | None:
    """llama.cpp's memory rules for `architecture`, or None when the planner does not know it.

    Args:
        architecture: `general.architecture` of the GGUF.
    """
    return _RULES.get(architecture)


def swa_pattern(n_layers: int, pattern: int, *, dense_first: bool = False) -> tuple[bool, ...]:
    """Which layers slide for a numeric pattern, as `llama_hparams::set_swa_pattern` computes it.

    Args:
        n_layers: blocks.
        pattern: of every `pattern` layers the last one is full attention (the first with `dense_first`); 0
            makes every layer slide.
        dense_first: the full-attention layer leads each group instead of closing it.

    Returns:
        One flag per block, True where the block attends through the sliding window.
    """
    if pattern == 0:
        return (True,) * n_layers
    if dense_first:
        return tuple(il % pattern != 0 for il in range(n_layers))
    return tuple(il % pattern < pattern - 1 for il in range(n_layers))
