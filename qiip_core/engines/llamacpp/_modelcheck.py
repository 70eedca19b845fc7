"""Everything checkable about a model file before anything is stopped or started for it, in bounded time and memory.

`inspect_model` is what every launch, relaunch and `qiip up` asks first, so a file that cannot be served is refused
with one sentence naming the file and the reason, before a node is drained or a daemon started:

1. `read_gguf_metadata`: a readable, whole GGUF (not cut short, the first shard of a complete family) whose shape
   is within bounds (`check_bounds`: layers, context length, heads, widths, experts), checked before anything is
   sized by it;
2. the architecture is one llama.cpp loads (`LLAMA_CPP_ARCHITECTURES`, read from the pinned source's
   `src/llama-arch.cpp`; a build of another version is trusted with its own list, and `llama-fit-params` says
   when it does not know one);
3. the planner's view of it builds (`ModelShape.from_metadata`: per-layer arrays of the right length, expert
   counts that agree);
4. for an architecture the planner models, the tensors llama.cpp needs are there: the input embedding, at least
   one tensor per block, and the attention projections (Q, K, V and output, or the fused QKV) of every block that
   attends.

What still needs llama-server itself (the tokenizer, a tensor's shape) is found by the launch, which rolls back.
"""

from __future__ import annotations

from pathlib import Path

from qiip_core._errors import ModelFileError
from qiip_core.engines.llamacpp._gguf import GgufMetadata, read_gguf_metadata
from qiip_core.planner import ModelShape

__all__ = ["LLAMA_CPP_ARCHITECTURES", "PINNED_ENGINE_VERSION", "inspect_model"]

PINNED_ENGINE_VERSION = "0.3.36"
"""The llama.cpp source version `LLAMA_CPP_ARCHITECTURES` was read from (llama-cpp-python's sdist)."""

LLAMA_CPP_ARCHITECTURES = frozenset(
    {
        "afmoe",
        "apertus",
        "arcee",
        "arctic",
        "arwkv7",
        "baichuan",
        "bailingmoe",
        "bailingmoe2",
        "bailingmoe3",
        "bert",
        "bitnet",
        "bloom",
        "chameleon",
        "chatglm",
        "clip",
        "codeshell",
        "cogvlm",
        "cohere2",
        "cohere2moe",
        "command-r",
        "dbrx",
        "deci",
        "deepseek",
        "deepseek2",
        "deepseek2-ocr",
        "deepseek32",
        "deepseek4",
        "dflash",
        "dots1",
        "dots3note",
        "dream",
        "eagle3",
        "ernie4_5",
        "ernie4_5-moe",
        "eurobert",
        "exaone",
        "exaone-moe",
        "exaone4",
        "falcon",
        "falcon-h1",
        "gemma",
        "gemma-embedding",
        "gemma2",
        "gemma3",
        "gemma3n",
        "gemma4",
        "gemma4-assistant",
        "glm-dsa",
        "glm4",
        "glm4moe",
        "glm5-next",
        "gpt-oss",
        "gpt2",
        "gptj",
        "gptneox",
        "granite",
        "granite_swa",
        "granitehybrid",
        "granitemoe",
        "graniteswitch",
        "grok",
        "grovemoe",
        "hrm_text",
        "hunyuan-dense",
        "hunyuan-moe",
        "hunyuan_vl",
        "hy_v3",
        "hy_v4",
        "internlm2",
        "jais",
        "jais2",
        "jamba",
        "jina-bert-v2",
        "jina-bert-v3",
        "kimi-k3",
        "kimi-linear",
        "laguna",
        "lfm2",
        "lfm2moe",
        "llada",
        "llada-moe",
        "llama",
        "llama-embed",
        "llama4",
        "maincoder",
        "mamba",
        "mamba2",
        "maple",
        "mellum",
        "mimo2",
        "minicpm",
        "minicpm3",
        "minimax-01",
        "minimax-m2",
        "minimax-m3",
        "mistral3",
        "mistral4",
        "modern-bert",
        "mpt",
        "muse-glimmer",
        "nanbeige",
        "nemotron",
        "nemotron_h",
        "nemotron_h_moe",
        "neo-bert",
        "nomic-bert",
        "nomic-bert-moe",
        "olmo",
        "olmo2",
        "olmoe",
        "openelm",
        "orion",
        "paddleocr",
        "pangu-embedded",
        "phi2",
        "phi3",
        "phimoe",
        "plamo",
        "plamo2",
        "plamo3",
        "plm",
        "pockettts",
        "qwen",
        "qwen2",
        "qwen2moe",
        "qwen2vl",
        "qwen3",
        "qwen35",
        "qwen35moe",
        "qwen3moe",
        "qwen3next",
        "qwen3tts",
        "qwen3vl",
        "qwen3vlmoe",
        "qwen4exp",
        "refact",
        "rnd1",
        "rwkv6",
        "rwkv6qwen2",
        "rwkv7",
        "seed_oss",
        "smallthinker",
        "smollm3",
        "spark2_5",
        "stablelm",
        "starcoder",
        "starcoder2",
        "step35",
        "t5",
        "t5encoder",
        "talkie",
        "wavtokenizer-dec",
        "xverse",
    }
)
"""Every `general.architecture` the pinned llama.cpp loads (`LLM_ARCH_NAMES` in `src/llama-arch.cpp`)."""


def _known(architecture: str, engine_version: str | None) -> bool:
    if engine_version not in (None, PINNED_ENGINE_VERSION, "unknown"):
        return True  # another llama.cpp: its own list is not known here; llama-fit-params checks
    if architecture in LLAMA_CPP_ARCHITECTURES:
        return True
    from gguf.constants import MODEL_ARCH_NAMES

    return architecture in set(MODEL_ARCH_NAMES.values())


def inspect_model(path: Path, *, engine_version: str | None = None) -> tuple[GgufMetadata, ModelShape]:
    """Read a model file and check everything about it that can be checked without loading it.

    Args:
        path: the GGUF (the first shard of a split family).
        engine_version: the llama.cpp build's version (`InstalledEngine.version`): an architecture is refused as
            unknown only against the pinned version's list (or a binary of unknown version); None means the pinned
            one.

    Returns:
        The metadata and the planner's shape of the model.

    Raises:
        ModelFileError: one sentence naming the file and the reason: not a whole GGUF, out of bounds, an unknown
            architecture, inconsistent per-layer values, or a tensor llama.cpp needs is missing.
    """
    metadata = read_gguf_metadata(path)
    arch = metadata.architecture
    if not _known(arch, engine_version):
        raise ModelFileError(
            f"{path} cannot be served: unknown architecture {arch[:80]!r}; llama.cpp {PINNED_ENGINE_VERSION} does not "
            "load it (a newer llama.cpp may: set engines.llamacpp.version).",
            path=path,
        )
    try:
        shape = ModelShape.from_metadata(metadata)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ModelFileError):
            raise
        raise ModelFileError(f"{path} cannot be served: {exc}", path=path) from None
    if shape.memory_known:
        _check_tensors(path, metadata, shape)
    return metadata, shape


def _check_tensors(path: Path, metadata: GgufMetadata, shape: ModelShape) -> None:
    """The tensors every block of a modelled architecture needs (llama.cpp's `create_tensor` for them is not
    optional)."""
    names = {t.name for t in metadata.tensors}
    needed = ["token_embd.weight"]
    blocks = [f"blk.{il}." for il in range(shape.n_layers)]
    present = {name.split(".", 2)[1] for name in names if name.startswith("blk.") and name.count(".") >= 2}
    for il, prefix in enumerate(blocks):
        if str(il) not in present:
            raise ModelFileError(
                f"{path} cannot be served: block {il} has no tensors ({prefix}*), though the file declares "
                f"{shape.n_layers} blocks; the file is damaged or was written by a broken converter.",
                path=path,
            )
        if shape.layer_kv_heads(il) > 0:
            if f"{prefix}attn_qkv.weight" in names:
                needed.append(f"{prefix}attn_output.weight")
            else:
                needed += [f"{prefix}attn_{p}.weight" for p in ("q", "k", "v", "output")]
    missing = [name for name in needed if name not in names]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFileError(
            f"{path} cannot be served: tensor {missing[0]} is missing{more}; the file is damaged or was written by "
            "a broken converter.",
            path=path,
        )
