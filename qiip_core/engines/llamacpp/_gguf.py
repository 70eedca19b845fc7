"""Read what a GGUF model file says about itself, and refuse a file llama-server could not load.

`read_gguf_metadata` opens a model (a single file, or the first shard of a split family), checks that it is
whole, and returns `GgufMetadata`: the common shape keys every decoder has (`<arch>.block_count`,
`.embedding_length`, `.attention.head_count`, …), every other metadata value as it is stored (the sizing planner
reads architecture-specific keys such as `<arch>.attention.sliding_window` or `<arch>.expert_count` from it), and
one `GgufTensor` per tensor across all shards.

A file is refused with `ModelFileError` naming the file and the reason when it is not a GGUF (wrong magic), is
cut short (a tensor's data runs past the end of the file, or the header cannot be parsed), is a shard other than
the first of a split family (`llama-server --model` takes shard 1), is a shard whose siblings are missing, or
declares a shape no model has (`check_bounds`: 0 or more than 512 layers, a context length of 0 or past any
model's, no attention heads in a model that attends, more K/V heads than heads). The bounds are checked before
anything is sized by them, so a header that claims 100,000 layers costs no more to refuse than a good one to read.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qiip_core._errors import ModelFileError
from qiip_core.engines.llamacpp._gguf_header import GgufFormatError, GgufHeader, RawTensor, read_header

__all__ = [
    "MAX_CONTEXT_LENGTH",
    "MAX_EXPERTS",
    "MAX_LAYERS",
    "GgufMetadata",
    "GgufTensor",
    "check_bounds",
    "read_gguf_metadata",
    "shard_paths",
]

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file (`GGUF_MAGIC` in gguf.h)."""

MAX_LAYERS = 512
"""Blocks llama.cpp loads at most (`LLAMA_MAX_LAYERS` in `src/llama-hparams.h`)."""

MAX_EXPERTS = 1024
"""Experts per block llama.cpp loads at most (`LLAMA_MAX_EXPERTS`)."""

MAX_CONTEXT_LENGTH = 1 << 27
"""The longest training context accepted, in tokens (134,217,728: ten times the longest of any published model);
a larger `context_length` is a damaged header."""

MAX_HEADS = 4096
"""Attention heads per block accepted (the largest published models have 128)."""

MAX_WIDTH = 1 << 20
"""Embedding and feed-forward widths accepted (the largest published models are below 65,536)."""

MAX_VOCAB = 1 << 24
"""Vocabulary size accepted (the largest published vocabularies are about 262,144)."""

RECURRENT_ONLY = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
"""Architectures without attention in any block: their files may say 0 heads (the converter writes the keys,
unused)."""

_SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor of a GGUF file, as the file describes it."""

    name: str
    """`blk.3.ffn_up.weight`, `token_embd.weight`, …"""
    ggml_type: str
    """The ggml type name in upper case: `F16`, `Q4_K`, `Q8_0`, …"""
    ne: tuple[int, ...]
    """Elements per dimension, innermost first (ggml's `ne`): a weight matrix is `(n_in, n_out)`."""
    n_bytes: int
    """Bytes of its data."""
    shard: int = 0
    """Which file of a split family holds it (0 for the first, or only, file)."""
    offset: int | None = None
    """Where its data starts in that file, in bytes from the file's start (what llama.cpp maps); None when
    unknown."""


@dataclass(frozen=True, kw_only=True)
class GgufMetadata:
    """The shape of a GGUF model, its metadata values and its tensors."""

    architecture: str
    """`general.architecture`, such as `llama` or `gemma3`."""
    n_layers: int
    """`<arch>.block_count`."""
    n_embd: int
    """`<arch>.embedding_length`."""
    n_head: int
    """`<arch>.attention.head_count` (the largest, when it varies by layer)."""
    n_head_kv: int
    """`<arch>.attention.head_count_kv` (the largest, when it varies by layer); `n_head` when absent."""
    n_ctx_train: int
    """`<arch>.context_length`, the training context in tokens."""
    n_vocab: int
    """`<arch>.vocab_size`, else the length of `tokenizer.ggml.tokens`."""
    head_dim_k: int
    """Per-head K width: `<arch>.attention.key_length`, else `n_embd / n_head`."""
    head_dim_v: int
    """Per-head V width: `<arch>.attention.value_length`, else `n_embd / n_head`."""
    tensor_bytes: int
    """Bytes of tensor data across all shards."""
    paths: tuple[Path, ...]
    """The files: one, or every shard of a split family in order."""
    n_ff: int | None = None
    """`<arch>.feed_forward_length` (the largest, when it varies by layer); None when absent."""
    block_tensor_bytes: tuple[int, ...] = ()
    """Bytes of the `blk.N.*` tensors of each block, in block order (what one layer weighs)."""
    token_embd_bytes: int = 0
    """Bytes of `token_embd.weight`, the input embedding."""
    has_output_weight: bool = True
    """Whether `output.weight` exists; without it the output projection reuses `token_embd.weight`."""
    values: Mapping[str, Any] = field(default_factory=dict)
    """Every metadata key and its value (`gguf.ReaderField.contents()`), except the vocabulary arrays, whose
    lengths are kept instead (`tokenizer.ggml.tokens` → an int)."""
    tensors: tuple[GgufTensor, ...] = ()
    """Every tensor across all shards, in file order."""

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value; `{arch}` in `key` stands for the architecture (`{arch}.expert_count`).

        Args:
            key: the GGUF key.
            default: what to return when the key is absent.
        """
        return self.values.get(key.format(arch=self.architecture), default)

    def layer_values(self, key: str, default: int) -> tuple[int, ...]:
        """A per-layer integer key as one value per block.

        llama.cpp reads keys such as `head_count_kv` and `feed_forward_length` either as one number for every
        layer or as an array with one entry per layer (`get_key_or_arr`).

        Args:
            key: the GGUF key, `{arch}` standing for the architecture.
            default: the value of every layer when the key is absent.

        Raises:
            ModelFileError: an array whose length is not the block count.
        """
        raw = self.value(key)
        if raw is None:
            return (default,) * self.n_layers
        if isinstance(raw, list):
            if len(raw) != self.n_layers:
                raise ModelFileError(
                    f"{self.paths[0]} has {len(raw)} values of {key.format(arch=self.architecture)} for "
                    f"{self.n_layers} blocks; the file is damaged or was written by a broken converter.",
                    path=self.paths[0],
                )
            return tuple(int(v) for v in raw)
        return (int(raw),) * self.n_layers


def shard_paths(path: Path) -> tuple[Path, ...] | None:
    """The shards of the split family `path` is named after (`NAME-00001-of-0000N.gguf`), or None.

    Args:
        path: a GGUF file name.

    Returns:
        Every shard's path in order, or None when the name is not a shard name.
    """
    match = _SHARD_RE.match(path.name)
    if match is None:
        return None
    count = int(match["count"])
    return tuple(path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1))


def _open(file: Path) -> GgufHeader:
    try:
        # Before opening: opening a FIFO blocks until a writer comes, and a device never ends.
        kind = file.stat().st_mode  # through symlinks
        if stat.S_ISDIR(kind):
            raise IsADirectoryError
        if not stat.S_ISREG(kind):
            raise ModelFileError(
                f"The model path {file} is not a regular file (a FIFO, a socket or a device); give a GGUF file.",
                path=file,
            )
        with file.open("rb") as handle:
            magic = handle.read(4)
    except FileNotFoundError:
        raise ModelFileError(f"The model file {file} does not exist.", path=file) from None
    except IsADirectoryError:
        raise ModelFileError(f"The model path {file} is a directory, not a GGUF file.", path=file) from None
    except OSError as exc:
        raise ModelFileError(f"The model file {file} cannot be read: {exc.strerror}.", path=file) from exc
    if magic != GGUF_MAGIC:
        raise ModelFileError(
            f"{file} is not a GGUF model: it starts with {magic!r}, not b'GGUF'. llama.cpp serves GGUF files only; "
            "convert the model with llama.cpp's convert_hf_to_gguf.py.",
            path=file,
        )
    try:
        header = read_header(file)
    except (GgufFormatError, OSError) as exc:
        raise ModelFileError(
            f"{file} is truncated or damaged: it ends before the header and tensors it describes, or holds values "
            "no model has. Download it again.",
            path=file,
        ) from exc
    size = file.stat().st_size
    for tensor in header.tensors:
        end = tensor.offset + tensor.n_bytes
        if end > size:
            raise ModelFileError(
                f"{file} is truncated: it has {size:,} bytes but tensor {tensor.name} ends at byte {end:,}. "
                "Download it again.",
                path=file,
            )
    return header


def _as_int(value: Any, key: str, path: Path) -> int:
    if isinstance(value, list):
        # Per-layer values (some architectures vary head counts by layer): the largest bounds the sizes.
        value = max(value) if value else None
    if value is None or isinstance(value, str):
        raise ModelFileError(f"{path} has no usable {key} value; it is not a complete model GGUF.", path=path)
    return int(value)


def check_bounds(values: Mapping[str, Any], path: Path) -> None:
    """Refuse a header whose shape no model has, before anything is sized by it.

    Args:
        values: the file's metadata values (`read_header`), `general.architecture` among them.
        path: the file, for the message.

    Raises:
        ModelFileError: one sentence naming the file, the key and the bound: `declares 100,000 layers`, `context_length
            is 0`, `head_count is 0`, …
    """
    arch = values.get("general.architecture")

    def number(key: str) -> int | None:
        raw = values.get(f"{arch}.{key}")
        if isinstance(raw, list):
            raw = max(raw) if raw and all(isinstance(v, int) for v in raw) else None
        return raw if isinstance(raw, int) and not isinstance(raw, bool) else None

    def refuse(reason: str) -> ModelFileError:
        return ModelFileError(f"{path} cannot be served: {reason}; the header is damaged or not a model's.", path=path)

    layers = number("block_count")
    if layers is not None and not 1 <= layers <= MAX_LAYERS:
        raise refuse(f"it declares {layers:,} layers (block_count), and llama.cpp loads 1 to {MAX_LAYERS}")
    context = number("context_length")
    if context == 0:
        raise refuse("context_length is 0")
    if context is not None and not 0 < context <= MAX_CONTEXT_LENGTH:
        raise refuse(f"context_length is {context:,} tokens, past the longest accepted ({MAX_CONTEXT_LENGTH:,})")
    heads, kv_heads = number("attention.head_count"), number("attention.head_count_kv")
    if heads is not None and heads == 0 and arch not in RECURRENT_ONLY:
        raise refuse("head_count is 0, and the model's blocks attend")
    if heads is not None and heads > MAX_HEADS:
        raise refuse(f"head_count is {heads:,}, past the most accepted ({MAX_HEADS:,})")
    if heads and kv_heads is not None and kv_heads > heads:
        raise refuse(f"head_count_kv ({kv_heads:,}) is more than head_count ({heads:,})")
    for key in ("embedding_length", "feed_forward_length"):
        width = number(key)
        if width is not None and width > MAX_WIDTH:
            raise refuse(f"{key} is {width:,}, past the widest accepted ({MAX_WIDTH:,})")
    vocab = number("vocab_size")
    if vocab is not None and not 0 < vocab <= MAX_VOCAB:
        raise refuse(f"vocab_size is {vocab:,}, not between 1 and {MAX_VOCAB:,}")
    experts, used = number("expert_count"), number("expert_used_count")
    if experts is not None and experts > MAX_EXPERTS:
        raise refuse(f"it declares {experts:,} experts (expert_count), and llama.cpp loads at most {MAX_EXPERTS}")
    if experts and used is not None and not 0 < used <= experts:
        raise refuse(f"expert_used_count is {used:,}, not between 1 and expert_count ({experts:,})")


def read_gguf_metadata(path: Path) -> GgufMetadata:
    """Read the shape, metadata and tensors of a GGUF model, and check that llama-server could load the file.

    Args:
        path: the `.gguf` file; for a split family, the first shard (`NAME-00001-of-0000N.gguf`), whose
            siblings are read too.

    Returns:
        The model's shape, its metadata values and its tensors across every shard.

    Raises:
        ModelFileError: the file does not exist, is not a regular file (a FIFO: never opened), is not a GGUF, is damaged
            or truncated, lacks a required key, is not the first shard of its family, a shard of its family is missing,
            or its shape is out of bounds (`check_bounds`; `.path` names the file).
    """
    path = Path(path)
    first = _open(path)
    values = {k: v for k, v in first.values.items() if not k.startswith("GGUF.")}
    count = values.get("split.count")
    paths: tuple[Path, ...] = (path,)
    if count is not None and int(count) > 1:
        number = int(values.get("split.no", 0))
        family = shard_paths(path)
        if family is None or len(family) != int(count):
            raise ModelFileError(
                f"{path} is shard {number + 1} of a {count}-file split GGUF but is not named "
                f"NAME-{number + 1:05d}-of-{int(count):05d}.gguf; rename the shards as llama-gguf-split wrote them.",
                path=path,
            )
        if number != 0:
            raise ModelFileError(
                f"{path} is shard {number + 1} of {count} of a split GGUF; pass the first shard, {family[0].name}, "
                "which llama-server loads with the others.",
                path=path,
            )
        missing = [p.name for p in family if not p.is_file()]
        if missing:
            raise ModelFileError(
                f"{path} is the first of {count} shards, but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} missing next to it.",
                path=path,
            )
        paths = family
    arch = values.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError(f"{paths[0]} has no general.architecture; it is not a model GGUF.", path=paths[0])

    check_bounds(values, paths[0])

    def get(key: str) -> Any:
        return values.get(key.format(arch=arch))

    tensors = [_tensor(t) for t in first.tensors]
    for index, shard in enumerate(paths[1:], start=1):
        tensors += [_tensor(t, index) for t in _open(shard).tensors]
    n_embd = _as_int(get("{arch}.embedding_length"), f"{arch}.embedding_length", paths[0])
    n_head = _as_int(get("{arch}.attention.head_count"), f"{arch}.attention.head_count", paths[0])
    kv = get("{arch}.attention.head_count_kv")
    n_head_kv = n_head if kv is None else _as_int(kv, f"{arch}.attention.head_count_kv", paths[0])
    vocab = get("{arch}.vocab_size")
    if vocab is None:
        vocab = values.get("tokenizer.ggml.tokens")
    default_head = n_embd // n_head if n_head else 0
    key_length, value_length = get("{arch}.attention.key_length"), get("{arch}.attention.value_length")
    n_layers = _as_int(get("{arch}.block_count"), f"{arch}.block_count", paths[0])
    blocks = [0] * n_layers
    for tensor in tensors:
        block = _BLOCK_RE.match(tensor.name)
        if block is not None and int(block[1]) < n_layers:
            blocks[int(block[1])] += tensor.n_bytes
    n_ff = get("{arch}.feed_forward_length")
    return GgufMetadata(
        architecture=arch,
        n_layers=n_layers,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ctx_train=_as_int(get("{arch}.context_length"), f"{arch}.context_length", paths[0]),
        n_vocab=_as_int(vocab, f"{arch}.vocab_size", paths[0]),
        head_dim_k=default_head if key_length is None else int(key_length),
        head_dim_v=default_head if value_length is None else int(value_length),
        tensor_bytes=sum(t.n_bytes for t in tensors),
        paths=paths,
        n_ff=None if n_ff is None else _as_int(n_ff, f"{arch}.feed_forward_length", paths[0]),
        block_tensor_bytes=tuple(blocks),
        token_embd_bytes=sum(t.n_bytes for t in tensors if t.name == "token_embd.weight"),
        has_output_weight=any(t.name == "output.weight" for t in tensors),
        values=values,
        tensors=tuple(tensors),
    )


def _tensor(tensor: RawTensor, shard: int = 0) -> GgufTensor:
    return GgufTensor(
        name=tensor.name,
        ggml_type=tensor.ggml_type,
        ne=tensor.ne,
        n_bytes=tensor.n_bytes,
        shard=shard,
        offset=tensor.offset,
    )
