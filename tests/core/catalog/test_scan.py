"""The catalog over a real hub cache: generations, split families, safetensors models, issues and counters."""

from __future__ import annotations

from pathlib import Path

from qiip_core.catalog import IssueKind, artifact_id, scan_catalog
from qiip_core.engines.llamacpp import GEMMA3_270M
from tests.support.hf_cache import HfCacheBuilder
from tests.support.model_cache import COMMIT_A, COMMIT_B, GEMMA_COMMIT, GEMMA_REPO, TINY_REPO, ModelCache


def test_generations_are_standalone_files_and_complete_families(model_cache: ModelCache) -> None:
    catalog = scan_catalog(model_cache.root)
    offered = {(g.repo_id, g.revision, g.entrypoint): g for g in catalog.gguf}
    assert set(offered) == {
        (TINY_REPO, COMMIT_A, "tiny-F16.gguf"),
        (TINY_REPO, COMMIT_B, "tiny-F16.gguf"),
        (TINY_REPO, COMMIT_A, "split/tiny-split-00001-of-00003.gguf"),
        (TINY_REPO, COMMIT_A, "granite-F16.gguf"),
        (GEMMA_REPO, GEMMA_COMMIT, "gemma-3-270m-q4_k_m.gguf"),
        ("qiip-test/copied-GGUF", COMMIT_A, "copied.gguf"),
    }
    split = offered[(TINY_REPO, COMMIT_A, "split/tiny-split-00001-of-00003.gguf")]
    assert split.files == tuple(f"split/tiny-split-0000{n}-of-00003.gguf" for n in (1, 2, 3))
    assert split.size_bytes == sum(p.stat().st_size for p in model_cache.split)
    assert split.entrypoint_path.name == "tiny-split-00001-of-00003.gguf"
    # The second revision of the same file is its own generation, with its refs.
    assert offered[(TINY_REPO, COMMIT_B, "tiny-F16.gguf")].refs == ("main",)
    assert offered[(TINY_REPO, COMMIT_A, "tiny-F16.gguf")].refs == ("v1",)


def test_artifact_id_is_the_sha256_of_a_canonical_json(model_cache: ModelCache) -> None:
    catalog = scan_catalog(model_cache.root)
    ids = {g.artifact_id for g in catalog.gguf}
    assert len(ids) == len(catalog.gguf)
    gemma = next(g for g in catalog.gguf if g.repo_id == GEMMA_REPO)
    import hashlib

    canonical = (
        '{"entrypoint":"gemma-3-270m-q4_k_m.gguf","files":["gemma-3-270m-q4_k_m.gguf"],'
        f'"repo_id":"{GEMMA_REPO}","revision":"{GEMMA_COMMIT}"}}'
    )
    assert gemma.artifact_id == hashlib.sha256(canonical.encode()).hexdigest()
    assert artifact_id(repo_id="r", revision="c", files=["b", "a"], entrypoint="a") == artifact_id(
        repo_id="r", revision="c", files=("a", "b"), entrypoint="a"
    )
    assert scan_catalog(model_cache.root).generation(gemma.artifact_id) == gemma


def test_gguf_metadata_of_the_real_gemma_and_generated_models(model_cache: ModelCache) -> None:
    catalog = scan_catalog(model_cache.root)
    gemma = next(g for g in catalog.gguf if g.repo_id == GEMMA_REPO)
    assert (gemma.architecture, gemma.quantization, gemma.context_length) == ("gemma3", "Q4_K_M", 32768)
    assert gemma.size_bytes == GEMMA3_270M.size_bytes
    assert gemma.modelled and gemma.verifiable
    by_entry = {g.entrypoint: g for g in catalog.gguf if g.revision == COMMIT_A and g.repo_id == TINY_REPO}
    tiny = by_entry["tiny-F16.gguf"]
    assert (tiny.architecture, tiny.quantization, tiny.context_length, tiny.modelled) == ("llama", "F16", 2048, True)
    assert by_entry["granite-F16.gguf"].architecture == "granite"
    assert not by_entry["granite-F16.gguf"].modelled


def test_incomplete_unverifiable_and_invalid_entries_are_counted_not_hidden(model_cache: ModelCache) -> None:
    catalog = scan_catalog(model_cache.root)
    assert catalog.counters == {"incomplete": 2, "unverifiable": 1, "invalid": 1, "corrupted": 0}
    assert not catalog.degraded
    by_kind = {(i.kind, i.repo_id): i for i in catalog.issues}
    family = by_kind[(IssueKind.INCOMPLETE, TINY_REPO)]
    assert family.files == ("broken-00001-of-00003.gguf", "broken-00003-of-00003.gguf")
    assert "missing broken-00002-of-00003.gguf" in family.reason
    assert not any("broken" in g.entrypoint for g in catalog.gguf)
    partial = by_kind[(IssueKind.INCOMPLETE, "qiip-test/partial-safetensors")]
    assert "model-00002-of-00002.safetensors" in partial.reason
    assert "not a GGUF" in by_kind[(IssueKind.INVALID, TINY_REPO)].reason
    assert by_kind[(IssueKind.UNVERIFIABLE, "qiip-test/copied-GGUF")].files == ("copied.gguf",)
    assert not next(g for g in catalog.gguf if g.repo_id == "qiip-test/copied-GGUF").verifiable


def test_full_models_are_complete_safetensors_snapshots(model_cache: ModelCache) -> None:
    catalog = scan_catalog(model_cache.root)
    assert [m.repo_id for m in catalog.full] == ["qiip-test/tiny-safetensors"]
    model = catalog.full[0]
    assert model.entrypoint == "model.safetensors.index.json"
    assert "config.json" in model.files and len(model.files) == 4


def test_a_corrupted_repository_degrades_the_scan(tmp_path: Path, model_cache: ModelCache) -> None:
    cache = HfCacheBuilder(tmp_path / "hub")
    cache.add_file("ok/model-GGUF", COMMIT_A, "m.gguf", source=model_cache.tiny)
    cache.set_ref("ok/model-GGUF", "main", COMMIT_A)
    cache.add_file("bad/model-GGUF", COMMIT_A, "m.gguf", source=model_cache.tiny)
    cache.set_ref("bad/model-GGUF", "main", COMMIT_B)  # a ref to a commit the cache does not hold
    catalog = scan_catalog(cache.root)
    assert catalog.degraded
    assert [g.repo_id for g in catalog.gguf] == ["ok/model-GGUF"]
    assert [(i.kind, i.repo_id) for i in catalog.issues] == [(IssueKind.CORRUPTED, "bad/model-GGUF")]


def test_a_missing_cache_is_empty_not_degraded(tmp_path: Path) -> None:
    catalog = scan_catalog(tmp_path / "absent")
    assert not catalog.exists and not catalog.degraded and catalog.gguf == ()


def test_a_broken_link_hides_only_its_file(tmp_path: Path, model_cache: ModelCache) -> None:
    cache = HfCacheBuilder(tmp_path / "hub")
    cache.add_file("x/y", COMMIT_A, "good.gguf", source=model_cache.tiny)
    cache.add_file("x/y", COMMIT_A, "pruned.gguf", data=b"GGUF pruned from a shared cache")
    cache.add_file("x/y", COMMIT_A, "split/tiny-split-00001-of-00003.gguf", source=model_cache.split[0])
    cache.set_ref("x/y", "main", COMMIT_A)
    pruned = (cache.repo_dir("x/y") / "snapshots" / COMMIT_A / "pruned.gguf").resolve()
    pruned.unlink()
    catalog = scan_catalog(cache.root)
    assert not catalog.degraded
    assert [(g.repo_id, g.entrypoint, g.refs) for g in catalog.gguf] == [("x/y", "good.gguf", ("main",))]
    broken = [i for i in catalog.issues if i.files == ("pruned.gguf",)]
    assert [(i.kind, i.repo_id, i.revision) for i in broken] == [(IssueKind.INCOMPLETE, "x/y", COMMIT_A)]
    assert f"pruned.gguf links to the blob {pruned.name}, which is missing" in broken[0].reason
    # A ref to a commit that is not cached is still a repository that cannot be read.
    cache.set_ref("x/y", "v2", COMMIT_B)
    again = scan_catalog(cache.root)
    assert again.degraded and again.gguf == ()
