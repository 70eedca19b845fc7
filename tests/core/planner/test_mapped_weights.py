"""CPU mode's mapped weights (`CPU_Mapped`): the range from the first to the last tensor that is not repacked."""

from __future__ import annotations

from dataclasses import replace

from qiip_core.engines.llamacpp import make_test_gguf, read_gguf_metadata
from qiip_core.planner import ModelShape
from qiip_core.planner._estimate import mapped_bytes, repacked_bytes
from qiip_core.planner._shape import StoredTensor, WeightMatrix
from tests.core.planner.conftest import cpu, gpu, shape

AVX2 = replace(cpu(10**6), repack=(("Q4_0", 8),))


def stored(shard: int, *spans: tuple[str, int, int]) -> tuple[StoredTensor, ...]:
    return tuple(StoredTensor(name, shard, offset, size) for name, offset, size in spans)


def with_files(matrices: tuple[WeightMatrix, ...], tensors: tuple[StoredTensor, ...]) -> ModelShape:
    return replace(shape(), weight_matrices=matrices, stored_tensors=tensors)


UP = WeightMatrix("blk.3.ffn_up_exps.weight", "Q4_0", 512, 4000)
Q = WeightMatrix("blk.0.attn_q.weight", "Q4_0", 256, 1000)


def test_without_file_positions_every_tensor_is_mapped():
    assert mapped_bytes(shape(weights_bytes=12345), AVX2) == 12345


def test_repacked_weights_at_the_end_of_a_file_are_not_mapped():
    files = stored(0, ("output.weight", 100, 500), ("blk.3.ffn_norm.weight", 608, 256), (UP.name, 864, 4000))
    model = with_files((UP,), files)
    assert mapped_bytes(model, AVX2) == 608 + 256 - 100
    assert repacked_bytes(model, AVX2) == 4000
    # Nothing is repacked on a host without the instruction sets, or on a GPU: the whole range, padding included.
    assert mapped_bytes(model, cpu(10**6)) == mapped_bytes(model, gpu(0, 1000)) == 864 + 4000 - 100


def test_repacked_weights_between_mapped_ones_stay_in_the_range_and_each_file_counts():
    files = stored(0, ("token_embd.weight", 64, 100), (Q.name, 164, 1000), ("blk.0.attn_norm.weight", 1164, 36))
    files += stored(1, (UP.name, 32, 4000), ("output_norm.weight", 4032, 64))
    model = with_files((Q, UP), files)
    assert mapped_bytes(model, AVX2) == (1164 + 36 - 64) + 64


def test_read_models_carry_every_tensors_place(tmp_path):
    paths = make_test_gguf(tmp_path / "fam.gguf", split=2)
    meta = read_gguf_metadata(paths[0])
    model = ModelShape.from_metadata(meta)
    assert len(model.stored_tensors) == len(meta.tensors) == 21
    assert {t.shard for t in model.stored_tensors} == {0, 1}
    first = [t for t in model.stored_tensors if t.shard == 0]
    assert all(a.offset + a.n_bytes <= b.offset for a, b in zip(first, first[1:], strict=False))
    # F16 matrices and F32 norms leave no padding: the mapped ranges are the tensors' bytes.
    assert mapped_bytes(model, AVX2) == model.weights_bytes
