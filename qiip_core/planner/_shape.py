"""The shape of a model as the planner sees it, and the exact K/V cache arithmetic.

A `ModelShape` is everything memory depends on: block count, widths, head counts and sizes, feed-forward width,
vocabulary, training context, where the weight bytes sit (per block, input embedding, output), and, per block,
what kind of layer it is: full or sliding-window attention, a recurrent (state-space or convolution) layer, a
dense or mixture-of-experts feed-forward. It comes from `read_gguf_metadata` (`ModelShape.from_metadata`, which
applies llama.cpp's per-architecture rules from `_arch.py`) or is written by hand in tests.

The K/V cache is exact arithmetic over llama.cpp's layout (`llama_kv_cache`): per attention layer one K tensor of
`n_head_kv * head_dim_k` elements per cell and one V tensor of `n_head_kv * head_dim_v`, stored as F16 (2 bytes
per element) or Q8_0 (blocks of 32 elements in 34 bytes: 32 int8 values and one F16 scale). Which layers go in
which cache, and how many cells each cache has, is `_memory.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from qiip_core.planner._arch import POOLING_TYPES, MemoryKind, Pooling, rules_for, swa_pattern
from qiip_core.planner._types import CacheType, ModelMetadata

__all__ = [
    "ModelShape",
    "SsmShape",
    "StoredTensor",
    "WeightMatrix",
    "bytes_per_element",
    "kv_bytes_per_token",
    "row_bytes",
]

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


def bytes_per_element(dtype: str) -> float | None:
    """Bytes per value of a ggml type, blocks included (`ggml_type_size / ggml_blck_size`: 2 for `f16`, 34/32 for
    `q8_0`), or None for a type the planner does not model."""
    layout = _TYPE_LAYOUT.get(dtype)
    return None if layout is None else layout[0] / layout[1]


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
class SsmShape:
    """The widths of a Mamba-style state-space layer (`<arch>.ssm.*` keys)."""

    conv_kernel: int
    """`ssm.conv_kernel` (`d_conv`): the causal convolution's width in tokens."""
    inner_size: int
    """`ssm.inner_size` (`d_inner`): the expanded width the scan runs over."""
    state_size: int
    """`ssm.state_size` (`d_state`): the state per channel (Mamba) or per head dimension (Mamba-2)."""
    time_step_rank: int
    """`ssm.time_step_rank` (`dt_rank`): Mamba's Δ projection rank; Mamba-2's head count."""
    group_count: int = 0
    """`ssm.group_count` (`n_group`): Mamba-2's B/C groups; 0 for Mamba."""
    dt_b_c_rms: bool = False
    """`ssm.dt_b_c_rms` (Falcon-Mamba): Mamba's Δ, B and C are RMS-normalised before the scan."""


@dataclass(frozen=True, slots=True)
class WeightMatrix:
    """A 2-D (or, for experts, 3-D) weight a matrix multiplication reads: what the CPU backend may repack."""

    name: str
    """The tensor's name (`blk.0.ffn_up.weight`)."""
    ggml_type: str
    """Its ggml type in upper case (`Q4_K`)."""
    rows: int
    """`ne[1]`: output rows; repacking interleaves 4 or 8 of them and needs a whole number of groups."""
    n_bytes: int
    """Its size in bytes."""


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where one tensor's data sits in the model's files.

    llama.cpp maps, per file, the byte range from the first to the last tensor its CPU buffer holds
    (`llama_model_loader::get_mapping_range`); a weight the CPU backend repacks lives in `CPU_REPACK` instead, so
    repacked weights at either end of a file fall out of the `CPU_Mapped` range.
    """

    name: str
    """The tensor's name."""
    shard: int
    """The file of a split family that holds it (0: the first or only file)."""
    offset: int
    """Where its data starts in that file, in bytes."""
    n_bytes: int
    """Its size in bytes."""


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
    memory: MemoryKind = "kv"
    """The memory llama.cpp builds (`_arch.MemoryKind`): one K/V cache, a full and a sliding-window cache, a
    recurrent state, both (hybrid), or none (an encoder)."""
    memory_known: bool = True
    """Whether llama.cpp's memory rules for this architecture are known (`_arch.rules_for`); when not, the
    caches cannot be predicted and their checks are recorded as unverified."""
    kv_heads: tuple[int, ...] = ()
    """K/V heads of each block (`head_count_kv` as an array); 0 marks a block without attention. Empty means
    `n_head_kv` in every block."""
    ff_lengths: tuple[int, ...] = ()
    """Feed-forward width of each block (`feed_forward_length` as an array); empty means `n_ff` everywhere."""
    swa_window: int = 0
    """Sliding window in tokens (`<arch>.attention.sliding_window`); 0 without one."""
    swa_layers: tuple[bool, ...] = ()
    """Which blocks attend through the sliding window; empty means none."""
    head_dim_k_swa: int = 0
    """K head width of sliding-window blocks (`attention.key_length_swa`); 0 means `head_dim_k`."""
    head_dim_v_swa: int = 0
    """V head width of sliding-window blocks (`attention.value_length_swa`); 0 means `head_dim_v`."""
    recurrent_layers: tuple[bool, ...] = ()
    """Which blocks are recurrent (state-space or short convolution); empty means none."""
    ssm: SsmShape | None = None
    """The state-space widths of recurrent blocks (Mamba, Mamba-2, Granite hybrid)."""
    shortconv_cache: int = 0
    """`<arch>.shortconv.l_cache`: the short convolution's width in tokens (LFM2); 0 without one."""
    n_expert: int = 0
    """Experts per mixture-of-experts block (`<arch>.expert_count`); 0 for a dense model."""
    n_expert_used: int = 0
    """Experts each token is routed to (`<arch>.expert_used_count`)."""
    n_ff_expert: int = 0
    """One expert's feed-forward width (`<arch>.expert_feed_forward_length`; `n_ff` when absent)."""
    n_ff_shared_expert: int = 0
    """The shared expert's feed-forward width (`<arch>.expert_shared_feed_forward_length`); 0 without one."""
    causal: bool = True
    """`<arch>.attention.causal`: False for encoders, which attend both ways."""
    pooling: Pooling = "none"
    """The model's own pooling (`<arch>.pooling_type`); `none` for generative models."""
    fused_qkv: bool = False
    """The blocks project Q, K and V with one fused `attn_qkv` weight (BERT variants, nomic-bert)."""
    final_logit_softcap: bool = False
    """`<arch>.final_logit_softcapping` is set: the logits are squashed (scale, tanh, scale)."""
    weight_matrices: tuple[WeightMatrix, ...] = ()
    """The weights matrix multiplications read, for the CPU backend's repacking; empty when unknown."""
    stored_tensors: tuple[StoredTensor, ...] = ()
    """Every tensor's place in the files, for the mapped range in CPU mode; empty when unknown."""
    rope: bool = True
    """Attention blocks rotate Q and K; False for Granite hybrids without positional encoding
    (`<arch>.rope.scaling.finetuned` false, `hparams.rope_finetuned` in `granite-hybrid.cpp`)."""
    residual_scale: float = 0.0
    """`<arch>.residual_scale` (Granite): each block's outputs are scaled before their residual; 0 for none."""
    logit_scale: float = 0.0
    """`<arch>.logit_scale` (Granite): the logits are divided by it; 0 for none."""

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
        for name in ("kv_heads", "ff_lengths", "swa_layers", "recurrent_layers"):
            values = getattr(self, name)
            if values and len(values) != self.n_layers:
                raise ValueError(f"{name} has {len(values)} entries for {self.n_layers} blocks.")
        if any(self.swa_layers) and self.swa_window < 1:
            raise ValueError("sliding-window layers need a swa_window of at least 1 token.")
        if self.n_expert and not 1 <= self.n_expert_used <= self.n_expert:
            raise ValueError(
                f"n_expert_used must be between 1 and n_expert ({self.n_expert}), got {self.n_expert_used}."
            )

    @classmethod
    def from_metadata(cls, metadata: ModelMetadata) -> ModelShape:
        """The shape of a GGUF model, from `read_gguf_metadata`, with llama.cpp's rules for its architecture.

        Args:
            metadata: the model's metadata: a `qiip_core.engines.llamacpp.GgufMetadata`, or anything that reads
                the same (`ModelMetadata`).

        Returns:
            Its shape. A missing feed-forward width is taken as `4 * n_embd` (the llama default). For an
            architecture `_arch.rules_for` does not know, `memory_known` is False and the layer kinds are left at
            their defaults (every block a plain attention block).
        """
        n = metadata.n_layers
        rules = rules_for(metadata.architecture)
        kv_heads = metadata.layer_values("{arch}.attention.head_count_kv", metadata.n_head_kv)
        ff_lengths = metadata.layer_values("{arch}.feed_forward_length", metadata.n_ff or 0)
        recurrent: tuple[bool, ...] = ()
        swa: tuple[bool, ...] = ()
        window = int(metadata.value("{arch}.attention.sliding_window", 0) or 0)
        memory: MemoryKind = "kv"
        if rules is not None:
            memory = rules.base_memory
            if rules.recurrent == "all":
                recurrent = (True,) * n
            elif rules.recurrent == "no_kv_heads":
                recurrent = tuple(h == 0 for h in kv_heads)
            if rules.swa == "always":
                window = window or rules.swa_default_window
            sliding = window > 0 and rules.swa != "none"
            if sliding and rules.swa == "attention_layers":
                swa = tuple(not r for r in recurrent) if recurrent else (True,) * n
            elif sliding:
                swa = _swa_layers(metadata, n, rules.swa_pattern)
            if any(swa):
                memory = "iswa" if memory == "kv" else "hybrid_iswa" if memory == "hybrid" else memory
            else:
                window = 0
        else:
            window = 0
        ssm = None
        if metadata.value("{arch}.ssm.conv_kernel") is not None:
            ssm = SsmShape(
                conv_kernel=int(metadata.value("{arch}.ssm.conv_kernel")),
                inner_size=int(metadata.value("{arch}.ssm.inner_size", 0)),
                state_size=int(metadata.value("{arch}.ssm.state_size", 0)),
                time_step_rank=int(metadata.value("{arch}.ssm.time_step_rank", 0)),
                group_count=int(metadata.value("{arch}.ssm.group_count", 0) or 0),
                dt_b_c_rms=bool(metadata.value("{arch}.ssm.dt_b_c_rms", False)),
            )
        n_expert = int(metadata.value("{arch}.expert_count", 0) or 0)
        used = metadata.value("{arch}.expert_used_count", 0) or 0
        pooling_value = metadata.value("{arch}.pooling_type")
        causal = metadata.value("{arch}.attention.causal")
        n_ff = metadata.n_ff if metadata.n_ff is not None else 4 * metadata.n_embd
        return cls(
            architecture=metadata.architecture,
            n_layers=n,
            n_embd=metadata.n_embd,
            # Mamba models say 0 heads (the converter writes the keys, unused); nothing here sizes attention.
            n_head=max(1, metadata.n_head),
            n_head_kv=max(1, metadata.n_head_kv),
            head_dim_k=max(1, metadata.head_dim_k),
            head_dim_v=max(1, metadata.head_dim_v),
            n_ff=max(1, n_ff),
            n_ctx_train=metadata.n_ctx_train,
            n_vocab=metadata.n_vocab,
            weights_bytes=metadata.tensor_bytes,
            block_bytes=metadata.block_tensor_bytes,
            token_embd_bytes=metadata.token_embd_bytes,
            tied_output=not metadata.has_output_weight,
            memory=memory,
            memory_known=rules is not None,
            kv_heads=kv_heads if len(set(kv_heads)) > 1 else (),
            ff_lengths=ff_lengths if len(set(ff_lengths)) > 1 else (),
            swa_window=window,
            swa_layers=swa if any(swa) else (),
            head_dim_k_swa=int(metadata.value("{arch}.attention.key_length_swa", 0) or 0),
            head_dim_v_swa=int(metadata.value("{arch}.attention.value_length_swa", 0) or 0),
            recurrent_layers=recurrent if any(recurrent) else (),
            ssm=ssm,
            shortconv_cache=int(metadata.value("{arch}.shortconv.l_cache", 0) or 0),
            n_expert=n_expert,
            n_expert_used=int(max(used) if isinstance(used, list) else used),
            n_ff_expert=int(metadata.value("{arch}.expert_feed_forward_length", 0) or 0) or (n_ff if n_expert else 0),
            n_ff_shared_expert=int(metadata.value("{arch}.expert_shared_feed_forward_length", 0) or 0),
            causal=bool(causal) if causal is not None else (rules.causal if rules is not None else True),
            pooling=POOLING_TYPES.get(int(pooling_value), "none") if pooling_value is not None else "none",
            fused_qkv=any(t.name == "blk.0.attn_qkv.weight" for t in metadata.tensors),
            final_logit_softcap=bool(metadata.value("{arch}.final_logit_softcapping", 0.0)),
            weight_matrices=tuple(
                WeightMatrix(t.name, t.ggml_type, t.ne[1], t.n_bytes)
                for t in metadata.tensors
                if len(t.ne) in (2, 3) and t.name != "token_embd.weight"
            ),
            stored_tensors=_stored_tensors(metadata),
            # Granite models switch rotary embeddings off with `rope.scaling.finetuned` (`has_rope`).
            rope=not metadata.architecture.startswith("granite")
            or bool(metadata.value("{arch}.rope.scaling.finetuned", True)),
            residual_scale=float(metadata.value("{arch}.residual_scale", 0.0) or 0.0),
            logit_scale=float(metadata.value("{arch}.logit_scale", 0.0) or 0.0),
        )

    @property
    def total_layers(self) -> int:
        """Layers llama.cpp counts for offload: the blocks plus the output layer (`offloaded L/L layers`)."""
        return self.n_layers + 1

    @property
    def embeddings_pooling(self) -> Pooling:
        """The pooling llama-server runs with `--embeddings` as qiip launches it (`LaunchSpec.pooling`).

        The model's own (`<arch>.pooling_type`) when its GGUF declares one, else mean: llama-server's
        `--pooling` overrides the model's (`llama_context`: `cparams.pooling_type`), so qiip passes mean only
        to models that declare none, generative models among them.
        """
        return self.pooling if self.pooling != "none" else "mean"

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

    @property
    def embedding_model(self) -> bool:
        """Whether the model is made to embed, not generate: it declares a pooling, or it is an encoder without a
        cache. llama-server must run it with `--embeddings`."""
        return self.pooling != "none" or (self.memory == "none" and self.memory_known)

    def layer_kv_heads(self, il: int) -> int:
        """K/V heads of block `il`: 0 for a recurrent block (no attention)."""
        if self.recurrent_layers and self.recurrent_layers[il]:
            return 0
        return self.kv_heads[il] if self.kv_heads else self.n_head_kv

    def layer_ff(self, il: int) -> int:
        """Feed-forward width of block `il`."""
        return self.ff_lengths[il] if self.ff_lengths else self.n_ff

    def is_swa(self, il: int) -> bool:
        """Whether block `il` attends through the sliding window (`llama_hparams::is_swa`)."""
        return bool(self.swa_layers) and self.swa_layers[il]

    def is_recurrent(self, il: int) -> bool:
        """Whether block `il` is recurrent (`llama_hparams::is_recr`)."""
        return bool(self.recurrent_layers) and self.recurrent_layers[il]

    def layer_head_dims(self, il: int) -> tuple[int, int]:
        """K and V head widths of block `il` (sliding-window blocks may have their own)."""
        if self.is_swa(il):
            return (self.head_dim_k_swa or self.head_dim_k, self.head_dim_v_swa or self.head_dim_v)
        return self.head_dim_k, self.head_dim_v

    def attention_layers(self) -> tuple[int, ...]:
        """The blocks that have attention, and so K/V cache rows."""
        return tuple(il for il in range(self.n_layers) if self.layer_kv_heads(il) > 0)

    def supports_cache_type(self, cache_type: CacheType) -> bool:
        """Whether llama.cpp can store this model's K/V heads as `cache_type`.

        Q8_0 stores whole 32-element blocks, and the cache is viewed per head, so both head widths must be
        multiples of 32.
        """
        if cache_type == "q8_0":
            widths = [self.head_dim_k, self.head_dim_v]
            if self.swa_layers:
                widths += [self.head_dim_k_swa or self.head_dim_k, self.head_dim_v_swa or self.head_dim_v]
            return all(w % Q8_0_BLOCK == 0 for w in widths)
        return True


def kv_bytes_per_token(shape: ModelShape, cache_type: CacheType, *, layers: tuple[int, ...] | None = None) -> int:
    """Exact K/V cache bytes per cell (token) over the attention layers (or the given ones).

    This is llama.cpp's `llama_kv_cache` layout: per layer, `ggml_row_size(type_k, n_head_kv * head_dim_k)` +
    `ggml_row_size(type_v, n_head_kv * head_dim_v)`. Multiply by a cache's cells for the size the server logs in
    `llama_kv_cache: size = … MiB (N cells, …)`.

    Args:
        shape: the model.
        cache_type: `f16` (2 bytes per element) or `q8_0` (34 bytes per 32 elements).
        layers: the blocks of one cache; None means every attention block.

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
    total = 0
    for il in shape.attention_layers() if layers is None else layers:
        heads = shape.layer_kv_heads(il)
        dk, dv = shape.layer_head_dims(il)
        total += row_bytes(cache_type, heads * dk) + row_bytes(cache_type, heads * dv)
    return total


def _stored_tensors(metadata: ModelMetadata) -> tuple[StoredTensor, ...]:
    """Every tensor's place in the files; empty unless every tensor's offset is known."""
    stored = tuple(StoredTensor(t.name, t.shard, t.offset, t.n_bytes) for t in metadata.tensors if t.offset is not None)
    return stored if len(stored) == len(metadata.tensors) else ()


def _swa_layers(metadata: ModelMetadata, n_layers: int, default_pattern: int) -> tuple[bool, ...]:
    """`load_swa_pattern`: a per-layer array, a numeric pattern, or the architecture's default pattern."""
    raw = metadata.value("{arch}.attention.sliding_window_pattern")
    if isinstance(raw, list):
        return tuple(bool(v) for v in raw[:n_layers])
    return swa_pattern(n_layers, int(raw) if raw is not None else default_pattern)
