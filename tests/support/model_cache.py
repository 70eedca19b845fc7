"""The hub cache the model tests share: generated GGUFs, the real Gemma 3 270M, split families complete and
incomplete, safetensors models complete and incomplete, a copied (unverifiable) file and an invalid one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qiip_core.engines.llamacpp import GEMMA3_270M, make_test_gguf
from tests.support.hf_cache import HfCacheBuilder

__all__ = ["COMMIT_A", "COMMIT_B", "GEMMA_COMMIT", "GEMMA_REPO", "TINY_REPO", "ModelCache", "build_model_cache"]

TINY_REPO = "qiip-test/tiny-GGUF"
GEMMA_REPO = "google/gemma-3-270m-GGUF"
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
GEMMA_COMMIT = "0123456789abcdef0123456789abcdef01234567"
SAFETENSORS_COMMIT = "5afe" * 10


@dataclass(frozen=True)
class ModelCache:
    """Where the cache is, and the files that went into it."""

    root: Path
    tiny: Path
    """The standalone llama test GGUF (in TINY_REPO at COMMIT_A and COMMIT_B)."""
    split: list[Path]
    """A complete 3-shard family (TINY_REPO at COMMIT_A)."""


def build_model_cache(root: Path, work: Path, gemma: Path) -> ModelCache:
    """Write the shared cache under `root`, generating models in `work`."""
    cache = HfCacheBuilder(root)
    tiny = make_test_gguf(work / "tiny.gguf")[0]
    split = make_test_gguf(work / "tiny-split.gguf", split=3, seed=1)
    broken = make_test_gguf(work / "broken.gguf", split=3, seed=2)
    granite = make_test_gguf(work / "granite.gguf", architecture="granite", seed=3)[0]
    for commit in (COMMIT_A, COMMIT_B):
        cache.add_file(TINY_REPO, commit, "tiny-F16.gguf", source=tiny)
    for shard in split:
        cache.add_file(TINY_REPO, COMMIT_A, f"split/{shard.name}", source=shard)
    for shard in (broken[0], broken[2]):
        cache.add_file(TINY_REPO, COMMIT_A, shard.name, source=shard)
    cache.add_file(TINY_REPO, COMMIT_A, "granite-F16.gguf", source=granite)
    cache.add_file(TINY_REPO, COMMIT_A, "notes.gguf", data=b"this is not a GGUF file\n" * 4)
    cache.add_file(TINY_REPO, COMMIT_A, "README.md", data=b"# tiny\n", lfs=False)
    cache.set_ref(TINY_REPO, "main", COMMIT_B)
    cache.set_ref(TINY_REPO, "v1", COMMIT_A)

    cache.add_file(GEMMA_REPO, GEMMA_COMMIT, "gemma-3-270m-q4_k_m.gguf", source=gemma, sha256=GEMMA3_270M.sha256)
    cache.set_ref(GEMMA_REPO, "main", GEMMA_COMMIT)

    cache.add_file("qiip-test/copied-GGUF", COMMIT_A, "copied.gguf", source=tiny, copy=True)
    cache.set_ref("qiip-test/copied-GGUF", "main", COMMIT_A)

    index = {
        "metadata": {"total_size": 16},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    for repo, shards in (("qiip-test/tiny-safetensors", (1, 2)), ("qiip-test/partial-safetensors", (1,))):
        cache.add_file(repo, SAFETENSORS_COMMIT, "config.json", data=b'{"model_type": "llama"}', lfs=False)
        cache.add_file(
            repo, SAFETENSORS_COMMIT, "model.safetensors.index.json", data=json.dumps(index).encode(), lfs=False
        )
        for n in shards:
            cache.add_file(repo, SAFETENSORS_COMMIT, f"model-0000{n}-of-00002.safetensors", data=bytes([n]) * 8)
        cache.set_ref(repo, "main", SAFETENSORS_COMMIT)
    return ModelCache(root=root, tiny=tiny, split=split)
