"""What is checked about a model file before anything starts for it: one reason per kind of damage, in bounded time
and memory whatever the header claims; and every good model (each test architecture, the real Gemma) passes."""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import pytest

from qiip_core import ModelFileError
from qiip_core.engines.llamacpp import TEST_ARCHITECTURES, inspect_model, make_test_gguf, read_gguf_metadata
from qiip_core.engines.llamacpp._gguf_header import MAX_KEPT_ARRAY, read_header
from tests.support.bad_models import BAD_MODELS, LLAMA_SERVER_REFUSES, write_bad_model


@pytest.mark.parametrize("kind", sorted(BAD_MODELS))
def test_each_kind_of_damage_is_named_with_the_file(tmp_path: Path, kind: str) -> None:
    path, reason = write_bad_model(tmp_path / f"{kind}.gguf", kind)
    tracemalloc.start()
    try:
        with pytest.raises(ModelFileError) as info:
            inspect_model(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.message.startswith(f"{path} cannot be served: ") and reason in info.value.message
    assert "\n" not in info.value.message and info.value.path == path
    assert peak < 16 * 1024 * 1024  # a header claiming 100,000 layers is refused before anything is sized by it


@pytest.mark.parametrize("architecture", TEST_ARCHITECTURES)
def test_every_test_architecture_passes(tmp_path: Path, architecture: str) -> None:
    path = make_test_gguf(tmp_path / f"{architecture}.gguf", architecture=architecture, n_vocab=320)[0]
    metadata, shape = inspect_model(path)
    assert metadata.architecture == shape.architecture == architecture


def test_the_real_gemma_passes(gemma_gguf: Path) -> None:
    assert inspect_model(gemma_gguf)[1].n_layers == 18


def test_what_only_llama_server_knows_passes(tmp_path: Path) -> None:
    path, _ = write_bad_model(tmp_path / "refused.gguf", LLAMA_SERVER_REFUSES)
    assert inspect_model(path)[0].values["tokenizer.ggml.model"] == "qiip-unknown-tokenizer"


def test_an_unknown_architecture_is_left_to_a_build_of_another_version(tmp_path: Path) -> None:
    path, _ = write_bad_model(tmp_path / "new.gguf", "unknown-architecture")
    with pytest.raises(ModelFileError, match="unknown architecture"):
        inspect_model(path, engine_version="unknown")
    assert inspect_model(path, engine_version="b9999")[0].architecture == "qiip-unknown-arch"


def test_a_header_that_claims_too_much_is_refused_without_building_it(tmp_path: Path) -> None:
    good = make_test_gguf(tmp_path / "good.gguf")[0]
    data = bytearray(good.read_bytes())
    struct.pack_into("<Q", data, 8, 2**40)  # the tensor count
    claims = tmp_path / "claims.gguf"
    claims.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="truncated or damaged"):
        read_gguf_metadata(claims)


def test_a_long_array_is_kept_as_its_length(tmp_path: Path) -> None:
    good = make_test_gguf(tmp_path / "good.gguf")[0]
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(good)
    writer = GGUFWriter(tmp_path / "charsmap.gguf", "llama")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            kind = field.types[0]
            writer.add_key_value(key, field.contents(), kind, field.types[1] if kind is GGUFValueType.ARRAY else None)
    writer.add_key_value(
        "tokenizer.ggml.precompiled_charsmap", [7] * (MAX_KEPT_ARRAY + 1), GGUFValueType.ARRAY, GGUFValueType.UINT8
    )
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = read_header(tmp_path / "charsmap.gguf")
    assert header.values["tokenizer.ggml.precompiled_charsmap"] == MAX_KEPT_ARRAY + 1
    inspect_model(tmp_path / "charsmap.gguf")
