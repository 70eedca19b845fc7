"""llmfit's `recommend --json`, as llmfit 1.1.17 really printed it, normalised to QIIP's terms.

The fixture files are llmfit's stdout, saved unchanged:

- `llmfit-recommend-apple-m3-max-128gb.json`: `llmfit --profile apple-m3-max-128gb recommend --json -n 8`
- `llmfit-recommend-bitnetcpp.json`: the same with `--runtime bitnetcpp -n 2` (a runtime QIIP does not run)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qiip_core import LlmfitError
from qiip_core.catalog import scan_catalog
from qiip_core.engines.llamacpp import make_test_gguf
from qiip_core.recommendations import HostRecommendations, catalog_repos, parse_recommendations
from tests.support.hf_cache import HfCacheBuilder

HERE = Path(__file__).parent
APPLE = (HERE / "llmfit-recommend-apple-m3-max-128gb.json").read_text()
BITNET = (HERE / "llmfit-recommend-bitnetcpp.json").read_text()

MODEL = "deepseek-ai/DeepSeek-R1-0528-Qwen3-8B"
GGUF_REPO = "unsloth/DeepSeek-R1-0528-Qwen3-8B-GGUF"


def test_every_model_is_ranked_in_llmfits_order_with_its_figures() -> None:
    raw = json.loads(APPLE)["models"]
    found = parse_recommendations(APPLE, host="gpu01", profile="apple-m3-max-128gb")
    assert found.host == "gpu01" and found.profile == "apple-m3-max-128gb" and found.llmfit_version == "1.1.17"
    assert [r.rank for r in found.recommendations] == list(range(1, len(raw) + 1))
    for r, m in zip(found.recommendations, raw, strict=True):
        assert r.repo == m["name"] and r.provider == m["provider"] and r.runtime_label == m["runtime"]
        assert r.estimated_tokens_per_s == m["estimated_tps"] and r.score == m["score"]
        # llmfit's `_gb` are binary gigabytes: the same number, named for its unit.
        assert r.memory_required_gib == m["memory_required_gb"]
        assert r.memory_available_gib == m["memory_available_gb"]
        assert r.quantization == m["best_quant"] and r.context_tokens == m["effective_context_length"]
        assert r.run_mode == m["run_mode"] and r.fit_level == m["fit_level"].lower()
        assert not r.in_catalog


def test_runtimes_are_qiips_names() -> None:
    found = parse_recommendations(APPLE, host="gpu01")
    by_label = {r.runtime_label: r.runtime for r in found.recommendations}
    assert by_label == {"vLLM": "vllm", "llama.cpp": "llama_cpp"}
    bitnet = parse_recommendations(BITNET, host="gpu01")
    assert {(r.runtime_label, r.runtime) for r in bitnet.recommendations} == {("bitnet.cpp", "unknown")}


def test_gguf_sources_are_typed_with_the_quantisation_and_no_guessed_file() -> None:
    found = parse_recommendations(APPLE, host="gpu01")
    deepseek = next(r for r in found.recommendations if r.repo == MODEL)
    assert deepseek.runtime == "llama_cpp" and deepseek.quantization == "Q8_0"
    assert [(s.repo, s.provider, s.quantization, s.file) for s in deepseek.gguf_sources] == [
        (GGUF_REPO, "unsloth", "Q8_0", None),
        ("mradermacher/DeepSeek-R1-0528-Qwen3-8B-GGUF", "mradermacher", "Q8_0", None),
    ]
    vllm = next(r for r in found.recommendations if r.runtime == "vllm")
    assert vllm.gguf_sources == () and vllm.quantization == "AWQ-4bit"


def test_the_hardware_is_the_profiles() -> None:
    system = parse_recommendations(APPLE, host="gpu01").system
    assert system.unified_memory and system.gpu_count == 1 and system.gpu_vram_gib == 128.0
    assert system.total_ram_gib == 128.0 and system.backend == "CUDA"


def test_in_catalog_is_an_exact_repository_match() -> None:
    repos = {MODEL, GGUF_REPO, MODEL.upper(), "deepseek-ai/DeepSeek-R1-0528-Qwen3"}
    found = parse_recommendations(APPLE, host="gpu01", catalog_repos=repos)
    marked = [r.repo for r in found.recommendations if r.in_catalog]
    assert marked == [MODEL]
    deepseek = next(r for r in found.recommendations if r.repo == MODEL)
    assert [s.in_catalog for s in deepseek.gguf_sources] == [True, False]


def test_catalog_repos_come_from_a_real_scan(tmp_path: Path) -> None:
    cache = HfCacheBuilder(tmp_path / "hub")
    commit = "c" * 40
    cache.add_file(MODEL, commit, "config.json", data=b'{"model_type": "qwen3"}', lfs=False)
    cache.add_file(MODEL, commit, "model.safetensors", data=b"\0" * 16)
    cache.set_ref(MODEL, "main", commit)
    [gguf] = make_test_gguf(tmp_path / "tiny.gguf")
    cache.add_file(GGUF_REPO, commit, "DeepSeek-R1-0528-Qwen3-8B-Q8_0.gguf", source=gguf)
    cache.set_ref(GGUF_REPO, "main", commit)
    assert catalog_repos(scan_catalog(tmp_path / "hub")) == {MODEL, GGUF_REPO}


def test_the_shape_round_trips_for_the_client() -> None:
    found = parse_recommendations(APPLE, host="gpu01", catalog_repos={GGUF_REPO})
    assert HostRecommendations.model_validate_json(found.model_dump_json()) == found


@pytest.mark.parametrize(
    ("stdout", "said"),
    [
        ("", "the output"),
        ("Error: something", "the output"),
        ('{"system": {}}', "models"),
        (json.dumps({**json.loads(APPLE), "models": [{"name": "x/y"}]}), "models.0.runtime"),
    ],
)
def test_output_of_another_shape_is_an_llmfit_error(stdout: str, said: str) -> None:
    with pytest.raises(LlmfitError, match="printed what `recommend --json` does not") as caught:
        parse_recommendations(stdout, host="gpu01")
    assert said in caught.value.message and caught.value.host == "gpu01" and caught.value.status == 502


def test_an_unknown_fit_level_is_refused() -> None:
    data = json.loads(APPLE)
    data["models"][0]["fit_level"] = "Roomy"
    with pytest.raises(LlmfitError, match="fit level 'Roomy'"):
        parse_recommendations(json.dumps(data), host="gpu01")
