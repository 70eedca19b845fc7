"""Artifact ids as operators use them: the whole id or a unique prefix of 8 or more hex characters, from the CLI and
the core alike; a prefix of several ids names them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from qiip_cli._main import cli
from qiip_core import ArtifactAmbiguous, ArtifactIdInvalid, ArtifactNotFound
from qiip_core.catalog import ModelStore, artifact_id, match_artifact_id, resolve_artifact_id, scan_catalog
from qiip_core.config import ModelSettings, Settings
from tests.support.model_cache import ModelCache


def _colliding_revisions() -> tuple[str, str]:
    """Two commits whose artifact ids (of one file, `m.gguf`, of `qiip-test/ids`) share their first 8 hex."""
    seen: dict[str, str] = {}
    for n in range(1 << 22):
        revision = f"{n:040x}"
        prefix = artifact_id(repo_id="qiip-test/ids", revision=revision, files=["m.gguf"], entrypoint="m.gguf")[:8]
        if prefix in seen:
            return seen[prefix], revision
        seen[prefix] = revision
    raise AssertionError("no two ids share 8 hex characters")


def _manifest(revision: str) -> dict[str, Any]:
    return {
        "name": "ids",
        "revision": revision,
        "source": "qiip-test/ids",
        "licence": "Apache-2.0",
        "format": "gguf",
        "entrypoint": "m.gguf",
        "files": [{"name": "m.gguf", "digest": "sha256:" + "0" * 64, "bytes": 1}],
    }


def test_a_prefix_names_one_id_or_says_which_it_could_be() -> None:
    ids = ["abcdef0123" + "0" * 54, "abcdef0199" + "1" * 54, "12345678" + "2" * 56]
    assert match_artifact_id(ids[2][:8], ids) == ids[2]
    assert match_artifact_id(ids[0], ids) == ids[0]
    assert match_artifact_id("abcdef01", []) is None
    with pytest.raises(ArtifactAmbiguous) as info:
        match_artifact_id("abcdef01", ids)
    assert info.value.matches == (ids[0], ids[1]) and f"({ids[0]}, {ids[1]})" in info.value.message
    for bad in ("abcdef0", "ABCDEF01", "abcdef0g", "x" * 65):
        with pytest.raises(ArtifactIdInvalid, match="first 8 or more"):
            match_artifact_id(bad, ids)


def test_prefixes_resolve_across_the_store_and_the_cache(tmp_path: Path, model_cache: ModelCache) -> None:
    settings = Settings(
        state_dir=tmp_path, models=ModelSettings(store_dir=tmp_path / "store", hf_cache_dir=model_cache.root)
    )
    store = ModelStore(tmp_path / "store", allowed_hosts=[])
    first, second = (store.register(_manifest(r))[0] for r in _colliding_revisions())
    assert first.artifact_id[:8] == second.artifact_id[:8] != first.artifact_id[:9]
    gemma = next(g for g in scan_catalog(model_cache.root).gguf if g.architecture == "gemma3")
    assert resolve_artifact_id(settings, gemma.artifact_id[:12]) == gemma.artifact_id
    assert resolve_artifact_id(settings, first.artifact_id[:9]) == first.artifact_id
    with pytest.raises(ArtifactAmbiguous) as info:
        resolve_artifact_id(settings, first.artifact_id[:8])
    assert set(info.value.matches) == {first.artifact_id, second.artifact_id}
    with pytest.raises(ArtifactNotFound, match="No artifact id starts with ffffffff0"):
        resolve_artifact_id(settings, "ffffffff0")

    # The CLI takes the same prefixes, and names the ids of an ambiguous one.
    runner = CliRunner()
    env = {"QIIP_STATE_DIR": str(tmp_path), "QIIP_MODELS__STORE_DIR": str(tmp_path / "store")}
    env["QIIP_MODELS__HF_CACHE_DIR"] = str(model_cache.root)
    verified = runner.invoke(cli, ["model", "verify", gemma.artifact_id[:8]], env=env)
    assert verified.exit_code == 0 and "ok    gemma-3-270m-q4_k_m.gguf" in verified.output
    ambiguous = runner.invoke(cli, ["model", "verify", first.artifact_id[:8]], env=env)
    assert ambiguous.exit_code == 1
    assert first.artifact_id in ambiguous.output and second.artifact_id in ambiguous.output
    assert ambiguous.output.count("\n") == 1
