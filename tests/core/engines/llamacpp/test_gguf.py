"""Reading GGUF files: what a model says about itself, and a precise refusal for every file llama-server cannot load."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qiip_core import EngineError, ModelFileError
from qiip_core.engines.llamacpp import TEST_ARCHITECTURES, make_test_gguf, read_gguf_metadata
from tests.support.cli import untraced_environ


def test_values_and_tensors_are_read(tmp_path):
    path = make_test_gguf(tmp_path / "m.gguf", n_layers=2, n_embd=64, n_head_kv=2, n_ctx_train=4096)[0]
    meta = read_gguf_metadata(path)
    assert meta.value("{arch}.context_length") == 4096
    assert meta.value("general.architecture") == "llama"
    # The vocabulary arrays are kept as their lengths only.
    assert meta.value("tokenizer.ggml.tokens") == 512
    assert meta.layer_values("{arch}.attention.head_count_kv", 0) == (2, 2)
    assert meta.layer_values("{arch}.no_such_key", 7) == (7, 7)
    up = next(t for t in meta.tensors if t.name == "blk.0.ffn_up.weight")
    assert (up.ggml_type, up.ne, up.n_bytes) == ("F16", (64, 256), 64 * 256 * 2)
    assert sum(t.n_bytes for t in meta.tensors) == meta.tensor_bytes


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ModelFileError, match=r"does not exist") as caught:
        read_gguf_metadata(tmp_path / "nowhere.gguf")
    assert caught.value.path == tmp_path / "nowhere.gguf"


def test_a_directory_is_not_a_model(tmp_path):
    with pytest.raises(ModelFileError, match="is a directory"):
        read_gguf_metadata(tmp_path)


def test_a_file_that_is_not_a_gguf_is_named_with_its_magic(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00not a gguf" * 10)
    with pytest.raises(ModelFileError, match=r"is not a GGUF model: it starts with") as caught:
        read_gguf_metadata(bad)
    # One error class for both kinds of caller: the engine's and the old ValueError ones.
    assert isinstance(caught.value, EngineError) and isinstance(caught.value, ValueError)


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_a_truncated_gguf_is_refused(tmp_path, keep):
    path = make_test_gguf(tmp_path / "m.gguf", n_vocab=2000)[0]
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelFileError, match=r"truncated"):
        read_gguf_metadata(path)


def test_a_gguf_cut_inside_its_header_is_damaged(tmp_path):
    path = make_test_gguf(tmp_path / "m.gguf")[0]
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelFileError, match=r"is truncated or damaged: it ends before"):
        read_gguf_metadata(path)


def test_a_later_shard_names_the_first(tmp_path):
    paths = make_test_gguf(tmp_path / "fam.gguf", split=3)
    with pytest.raises(ModelFileError, match=r"is shard 2 of 3 .* pass the first shard, fam-00001-of-00003.gguf"):
        read_gguf_metadata(paths[1])


def test_a_missing_shard_is_named(tmp_path):
    paths = make_test_gguf(tmp_path / "fam.gguf", split=3)
    paths[1].unlink()
    with pytest.raises(ModelFileError, match=r"fam-00002-of-00003.gguf is missing"):
        read_gguf_metadata(paths[0])


def test_a_renamed_shard_is_refused(tmp_path):
    paths = make_test_gguf(tmp_path / "fam.gguf", split=2)
    renamed = paths[0].rename(tmp_path / "first.gguf")
    with pytest.raises(ModelFileError, match=r"not named NAME-00001-of-00002.gguf"):
        read_gguf_metadata(renamed)


def _reference(path: Path) -> tuple[dict[str, Any], list[tuple[str, str, tuple[int, ...], int, int]]]:
    """What `gguf.GGUFReader` reads from `path`: values (lengths for the vocabulary) and the tensor table."""
    from gguf import GGUFReader

    from qiip_core.engines.llamacpp._gguf_header import LENGTH_ONLY

    reader = GGUFReader(path)
    values = {
        key: len(field.data) if key in LENGTH_ONLY else field.contents()
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.")
    }
    tensors = [
        (str(t.name), t.tensor_type.name, tuple(int(n) for n in t.shape), int(t.n_bytes), int(t.data_offset))
        for t in reader.tensors
    ]
    return values, tensors


@pytest.mark.parametrize("architecture", sorted(TEST_ARCHITECTURES))
def test_the_header_reader_agrees_with_gguf_readers_on_every_test_architecture(tmp_path, architecture):
    path = make_test_gguf(tmp_path / "m.gguf", architecture=architecture, n_embd=128, n_vocab=600)[0]
    meta = read_gguf_metadata(path)
    values, tensors = _reference(path)
    assert dict(meta.values) == values
    assert [(t.name, t.ggml_type, t.ne, t.n_bytes, t.offset) for t in meta.tensors] == tensors


def _reference_untraced(path: Path) -> tuple[dict[str, Any], list[list[Any]]]:
    """`_reference(path)` read in a process of its own that coverage does not trace, as JSON: `gguf.GGUFReader` is
    the oracle, not QIIP's code, and on the real Gemma (262,144 tokens) it takes 17 s of CPU, twice that traced.

    The reading depends only on the file's bytes and gguf's version, so it is kept beside the file under a name made
    of both (`.NAME.gguf-reader-VERSION-SHA256.json`) and read from there by later runs; a changed file or another gguf
    is read again.
    """
    with path.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    kept = path.parent / f".{path.name}.gguf-reader-{importlib.metadata.version('gguf')}-{digest}.json"
    if kept.exists():
        values, tensors = json.loads(kept.read_text())
        return values, tensors
    code = (
        "import json, sys; from pathlib import Path; "
        "from tests.core.engines.llamacpp.test_gguf import _reference; "
        "print(json.dumps(_reference(Path(sys.argv[1]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        env=untraced_environ(),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    values, tensors = json.loads(done.stdout)
    partial = kept.with_name(f"{kept.name}.{os.getpid()}.partial")
    partial.write_text(done.stdout)
    partial.replace(kept)
    return values, tensors


@pytest.mark.integration
def test_the_header_reader_agrees_with_gguf_readers_on_the_real_gemma(gemma_gguf):
    meta = read_gguf_metadata(gemma_gguf)
    values, tensors = _reference_untraced(gemma_gguf)
    assert json.loads(json.dumps(dict(meta.values))) == values and meta.value("tokenizer.ggml.tokens") == 262_144
    ours = [(t.name, t.ggml_type, t.ne, t.n_bytes, t.offset) for t in meta.tensors]
    assert json.loads(json.dumps(ours)) == tensors


def test_a_split_familys_later_file_reads_like_gguf_reader(tmp_path):
    paths = make_test_gguf(tmp_path / "fam.gguf", split=2)
    meta = read_gguf_metadata(paths[0])
    second = [(t.name, t.n_bytes, t.offset) for t in meta.tensors if t.shard == 1]
    assert second == [(name, n, offset) for name, _, _, n, offset in _reference(paths[1])[1]]
