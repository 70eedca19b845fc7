"""Model files that are wrong in one way each, made from a generated test model (`make_test_gguf`) by rewriting it
with the `gguf` package: the kinds of damage an operator meets (a header that claims too much, a tensor lost in
conversion, an architecture this llama.cpp does not know, a tokenizer it refuses).

```
write_bad_model(path, kind) -> (path, reason)     reason: what the refusal must say
```
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["BAD_MODELS", "LLAMA_SERVER_REFUSES", "rewrite_gguf", "write_bad_model"]

LLAMA_SERVER_REFUSES = "llama-server-refuses"
"""A model every check before a launch accepts and llama-server refuses to load (an unknown tokenizer)."""

BAD_MODELS: dict[str, tuple[dict[str, Any], str]] = {
    "unknown-architecture": ({"architecture": "qiip-unknown-arch"}, "unknown architecture 'qiip-unknown-arch'"),
    "context-length-zero": ({"values": {"llama.context_length": 0}}, "context_length is 0"),
    "context-length-absurd": (
        {"values": {"llama.context_length": 2**32 - 1}},
        "context_length is 4,294,967,295 tokens",
    ),
    "too-many-layers": ({"values": {"llama.block_count": 100_000}}, "declares 100,000 layers"),
    "zero-heads": ({"values": {"llama.attention.head_count": 0}}, "head_count is 0"),
    "missing-tensor": ({"drop": {"blk.1.attn_q.weight"}}, "tensor blk.1.attn_q.weight is missing"),
}
"""Kind → (the rewrite, what the refusal says about it)."""


def rewrite_gguf(
    source: Path,
    target: Path,
    *,
    architecture: str | None = None,
    values: Mapping[str, Any] | None = None,
    drop: set[str] | frozenset[str] = frozenset(),
) -> Path:
    """Write `target`: `source` with another architecture name (its `<arch>.*` keys renamed with it), some metadata
    values replaced (keeping their types), and some tensors left out.

    Args:
        source: a GGUF of F16/F32 tensors (what `make_test_gguf` writes).
        target: the file to write.
        architecture: the new `general.architecture`.
        values: key (after the rename) → new value.
        drop: tensor names to leave out.

    Returns:
        `target`.
    """
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(source)
    old = str(reader.fields["general.architecture"].contents())
    arch = architecture or old
    replaced = dict(values or {})
    writer = GGUFWriter(target, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        name = arch + key[len(old) :] if key.startswith(old + ".") else key
        kind = field.types[0]
        sub = field.types[1] if kind is GGUFValueType.ARRAY else None
        writer.add_key_value(name, replaced.pop(name, field.contents()), kind, sub_type=sub)
    assert not replaced, f"keys not in {source}: {sorted(replaced)}"
    for tensor in reader.tensors:
        if tensor.name not in drop:
            writer.add_tensor(tensor.name, tensor.data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def write_bad_model(path: Path, kind: str) -> tuple[Path, str]:
    """Write a small llama model damaged in the way `kind` names (`BAD_MODELS`, or `LLAMA_SERVER_REFUSES`).

    Returns:
        The file, and the reason a refusal must give (empty for `LLAMA_SERVER_REFUSES`: nothing before the launch
        refuses it).
    """
    from qiip_core.engines.llamacpp import make_test_gguf

    good = make_test_gguf(path.with_name(f".{path.stem}-source.gguf"))[0]
    try:
        if kind == LLAMA_SERVER_REFUSES:
            return rewrite_gguf(good, path, values={"tokenizer.ggml.model": "qiip-unknown-tokenizer"}), ""
        rewrite, reason = BAD_MODELS[kind]
        return rewrite_gguf(good, path, **rewrite), reason
    finally:
        good.unlink()
