"""Read a GGUF file's header — its metadata and tensor table — without reading the vocabulary into Python.

`gguf.GGUFReader` builds a numpy view for every element of every array it meets; a model with a 262,144-token
vocabulary (Gemma 3) takes it 8 seconds to open, and a planner that reads a model on every launch and relaunch
cannot wait that long. This module reads the same header, as the GGUF specification lays it out (little-endian,
versions 2 and 3), with `struct` over a memory map: scalars and small arrays become Python values, the vocabulary
arrays are stepped over and only their length is kept. The type codes and block sizes come from the `gguf`
package itself (`GGUFValueType`, `GGMLQuantizationType`, `GGML_QUANT_SIZES`), and the tests compare every value
and tensor with `GGUFReader`'s on the same files.

Reading a header costs bounded time and memory whatever it claims: every count is checked against what is left of
the file before anything is built from it, a file may declare at most `MAX_TENSORS` tensors and `MAX_VALUES`
metadata keys, an array of more than `MAX_KEPT_ARRAY` elements is kept as its length only (like the vocabulary),
and the strings kept may take `MAX_KEPT_STRING_BYTES` in all.

```
magic "GGUF" · u32 version · u64 tensor count · u64 metadata count
metadata:  string key · u32 value type · value   (string = u64 length + bytes; array = u32 type · u64 count · items)
tensors:   string name · u32 dimensions · u64 ne[dimensions] · u32 ggml type · u64 offset from the data start
data:      at the end of the header rounded up to `general.alignment` (32 by default)
```
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["GgufFormatError", "GgufHeader", "RawTensor", "read_header"]

LENGTH_ONLY = frozenset(
    {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"}
)
"""Vocabulary arrays: hundreds of thousands of entries nobody sizes memory from; only their length is kept."""

MAX_TENSORS = 65_536
"""Tensors a file may declare: a 512-layer model with merged experts has about 10,000."""

MAX_VALUES = 65_536
"""Metadata keys a file may declare: real models have fewer than 100."""

MAX_KEPT_ARRAY = 65_536
"""Elements of an array kept as a list; a longer one (a tokenizer's `precompiled_charsmap`) is kept as its length.
Per-layer arrays have at most 512 entries."""

MAX_KEPT_STRING_BYTES = 64 * 1024 * 1024
"""Bytes of metadata strings kept in all (chat templates are tens of KiB)."""

DEFAULT_ALIGNMENT = 32
"""`GGUF_DEFAULT_ALIGNMENT`: where tensor data starts when `general.alignment` is absent."""

_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
"""`GGUFValueType` → struct format of the fixed-size types (8 is a string, 9 an array)."""

_STRING, _ARRAY = 8, 9


class GgufFormatError(ValueError):
    """The bytes are not a whole GGUF header: cut short, an unknown type code, or values out of range."""


@dataclass(frozen=True, slots=True)
class RawTensor:
    """One entry of the tensor table."""

    name: str
    ggml_type: str
    """The ggml type's name (`F16`, `Q4_K`)."""
    ne: tuple[int, ...]
    """Elements per dimension, innermost first."""
    n_bytes: int
    """Bytes of its data."""
    offset: int
    """Where its data starts, in bytes from the start of the file."""


@dataclass(frozen=True, slots=True)
class GgufHeader:
    """A GGUF file's metadata and tensor table."""

    version: int
    values: dict[str, Any]
    """Every metadata value: scalars as Python values, arrays as lists, `LENGTH_ONLY` arrays as their length."""
    tensors: list[RawTensor]


class _Cursor:
    """Reads little-endian values from a buffer, raising `GgufFormatError` past its end."""

    def __init__(self, data: mmap.mmap | bytes) -> None:
        self.data = data
        self.at = 0
        self.kept_bytes = 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise GgufFormatError(f"the header ends at byte {len(self.data):,}, inside a value at byte {self.at:,}")
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return value

    def string(self) -> str:
        length = self.take("<Q")
        if self.at + length > len(self.data):
            raise GgufFormatError(f"a string of {length:,} bytes at byte {self.at:,} runs past the end")
        self.kept_bytes += length
        if self.kept_bytes > MAX_KEPT_STRING_BYTES:
            raise GgufFormatError(f"the header's strings take more than {MAX_KEPT_STRING_BYTES:,} bytes")
        raw = bytes(self.data[self.at : self.at + length])
        self.at += length
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            length = self.take("<Q")
            self.at += length
        if self.at > len(self.data):
            raise GgufFormatError("a string array runs past the end of the file")

    def value(self, kind: int, *, keep: bool) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise GgufFormatError(f"unknown value type {kind} at byte {self.at:,}")
        item, count = self.take("<I"), self.take("<Q")
        if count > len(self.data) - self.at:
            # Every element takes at least one byte: a count past the end of the file is a damaged header.
            raise GgufFormatError(f"an array of {count:,} elements at byte {self.at:,} runs past the end")
        if count > MAX_KEPT_ARRAY:
            keep = False
        if not keep:
            if item == _STRING:
                self.skip_strings(count)
            elif item in _SCALARS:
                self.at += count * struct.calcsize(_SCALARS[item])
                if self.at > len(self.data):
                    raise GgufFormatError("an array runs past the end of the file")
            else:
                raise GgufFormatError(f"an array of type {item} cannot be stepped over")
            return count
        return [self.value(item, keep=True) for _ in range(count)]


def read_header(path: Path) -> GgufHeader:
    """Read the metadata and tensor table of the GGUF file at `path`.

    Args:
        path: the file, which starts with `GGUF`.

    Returns:
        The header.

    Raises:
        GgufFormatError: the file is cut short, big-endian or of an unknown version, or holds an unknown type code.
        OSError: the file cannot be opened or mapped.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data)
        if cursor.take("<4s") != b"GGUF":
            raise GgufFormatError("the file does not start with GGUF")
        version = cursor.take("<I")
        if version not in (2, 3):
            raise GgufFormatError(f"GGUF version {version} is not one llama.cpp reads (2 or 3; big-endian?)")
        n_tensors, n_values = cursor.take("<Q"), cursor.take("<Q")
        if n_tensors > MAX_TENSORS or n_values > MAX_VALUES:
            raise GgufFormatError(
                f"the header declares {n_tensors:,} tensors and {n_values:,} metadata keys; a model has at most "
                f"{MAX_TENSORS:,} and {MAX_VALUES:,}"
            )
        values: dict[str, Any] = {}
        for _ in range(n_values):
            key = cursor.string()
            values[key] = cursor.value(cursor.take("<I"), keep=key not in LENGTH_ONLY)
        table = []
        for _ in range(n_tensors):
            name = cursor.string()
            dims = cursor.take("<I")
            if dims > 4:
                raise GgufFormatError(f"tensor {name} has {dims} dimensions; ggml has at most 4")
            ne = tuple(cursor.take("<Q") for _ in range(dims))
            code, offset = cursor.take("<I"), cursor.take("<Q")
            try:
                kind = GGMLQuantizationType(code)
                block, type_size = GGML_QUANT_SIZES[kind]
            except (ValueError, KeyError):
                raise GgufFormatError(f"tensor {name} has the unknown ggml type {code}") from None
            elements = 1
            for n in ne:
                elements *= n
            table.append((name, kind.name, ne, elements // block * type_size, offset))
        alignment = int(values.get("general.alignment", DEFAULT_ALIGNMENT)) or DEFAULT_ALIGNMENT
        start = -(-cursor.at // alignment) * alignment
    tensors = [RawTensor(name, kind, ne, n_bytes, start + offset) for name, kind, ne, n_bytes, offset in table]
    return GgufHeader(version=version, values=values, tensors=tensors)
