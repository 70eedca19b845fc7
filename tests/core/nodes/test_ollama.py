"""Reading an Ollama server's native answers (`/api/version`, `/api/tags`, `/api/ps`) and its model names, with the
shapes of ollama/ollama's `docs/api.md`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from qiip_core.config import load_settings
from qiip_core.nodes import (
    MAX_RESIDENT,
    Engine,
    Node,
    check_ollama_version,
    is_load_failure,
    listed_models,
    ollama_model_key,
    resident_models,
)
from qiip_core.upstream import node_error_reason

_PS_ENTRY = {
    "name": "mistral:latest",
    "model": "mistral:latest",
    "size": 5137025024,
    "digest": "2ae6f6dd7a3dd734790bbbf58b8909a606e0e7e97e94b7604e0aa7ae4490e6d8",
    "details": {"format": "gguf", "family": "llama", "quantization_level": "Q4_0"},
    "expires_at": "2024-06-04T14:38:31.83753-07:00",
    "size_vram": 5137025024,
    "context_length": 4096,
}


@pytest.mark.parametrize("version", ["0.6.0", "0.9.6", "0.9.7-rc1", "0.33.0", "v1.0.0", "1.2.3+build.5"])
def test_a_release_from_the_oldest_served_on_is_read(version: str) -> None:
    assert check_ollama_version({"version": version}) == version


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"version": "0.5.13"}, "Ollama 0.5.13 is older than 0.6.0, the oldest release QIIP serves"),
        ({"version": "0.0.0"}, "Ollama 0.0.0 is older than 0.6.0"),
        ({"version": "0.6"}, "did not answer an Ollama version"),
        ({"version": "0.9.6\n"}, "did not answer an Ollama version"),
        ({"version": "\u0660.\u0669.\u0666"}, "did not answer an Ollama version"),
        ({"version": 6}, "did not answer an Ollama version"),
        ({"version": "9" * 100 + ".0.0"}, "did not answer an Ollama version"),
        ({}, "did not answer an Ollama version"),
        (["0.9.6"], "did not answer an Ollama version"),
    ],
)
def test_another_answer_or_an_old_release_is_refused_in_one_line(body: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why) as refused:
        check_ollama_version(body)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("llama3.2", "llama3.2:latest"),
        ("llama3.2:3b", "llama3.2:3b"),
        ("registry.example:5000/org/model", "registry.example:5000/org/model:latest"),
        ("registry.example:5000/org/model:q4", "registry.example:5000/org/model:q4"),
    ],
)
def test_a_name_without_a_tag_is_filed_as_latest(name: str, key: str) -> None:
    assert ollama_model_key(name) == key


def test_the_model_list_keys_each_name_with_its_tag() -> None:
    body = {"models": [{"name": "deepseek-r1:latest", "model": "deepseek-r1:latest"}, {"name": "phi3"}]}
    assert listed_models(body) == {"deepseek-r1:latest", "phi3:latest"}
    assert listed_models({"models": []}) == frozenset()


@pytest.mark.parametrize("body", [{}, {"models": {}}, {"models": ["llama3.2"]}, [], None])
def test_a_model_list_of_another_shape_is_refused(body: Any) -> None:
    with pytest.raises(ValueError, match=r"GET /api/tags did not answer a model list"):
        listed_models(body)


def test_the_loaded_models_are_read_with_their_memory_and_expiry() -> None:
    (loaded,) = resident_models({"models": [_PS_ENTRY]})
    assert (loaded.name, loaded.size_bytes, loaded.vram_bytes, loaded.context_length) == (
        "mistral:latest",
        5137025024,
        5137025024,
        4096,
    )
    assert loaded.expires_at is not None and loaded.expires_at.astimezone(UTC) == datetime(
        2024, 6, 4, 21, 38, 31, 837530, tzinfo=UTC
    )
    # An older server says no context length; Go's zero time means no expiry known.
    older = {key: value for key, value in _PS_ENTRY.items() if key != "context_length"}
    (loaded,) = resident_models({"models": [older | {"expires_at": "0001-01-01T00:00:00Z"}]})
    assert loaded.context_length is None and loaded.expires_at is None


def test_at_most_a_bounded_number_of_loaded_models_is_kept() -> None:
    many = [_PS_ENTRY | {"name": f"m{i}:latest", "model": f"m{i}:latest"} for i in range(10 * MAX_RESIDENT)]
    loaded = resident_models({"models": many})
    assert len(loaded) == MAX_RESIDENT and loaded[0].name == "m0:latest"


@pytest.mark.parametrize(
    "entry",
    [
        {key: value for key, value in _PS_ENTRY.items() if key not in ("name", "model")},
        _PS_ENTRY | {"size": -1},
        _PS_ENTRY | {"size_vram": "5 GB"},
        _PS_ENTRY | {"size": True},
        _PS_ENTRY | {"size": 10**400, "size_vram": 10**400},  # would not fit a float: /metrics would fail
        _PS_ENTRY | {"name": "a\nb", "model": "a\nb"},
    ],
)
def test_a_loaded_model_without_its_name_or_sizes_is_skipped_and_hides_no_other(entry: dict[str, Any]) -> None:
    good = _PS_ENTRY | {"name": "good:1", "model": "good:1"}
    assert [m.name for m in resident_models({"models": [entry, good]})] == ["good:1"]


def test_each_name_counts_once() -> None:
    assert len(resident_models({"models": [_PS_ENTRY] * 10})) == 1


def test_an_ollama_node_is_registered_from_the_config_file_and_its_engine_is_named(tmp_path: Any) -> None:
    config = tmp_path / "qiip.toml"
    config.write_text('[[nodes]]\nid = "lab"\nendpoint = "http://127.0.0.1:11434"\nmodel = "llama3.2:3b"\n')
    config.write_text(config.read_text() + 'engine = "ollama"\n')
    (node,) = load_settings(config_file=config, state_dir=tmp_path).nodes
    assert node.engine is Engine.OLLAMA and Engine.OLLAMA.label == "Ollama"
    assert Node(id="lab", endpoint="http://127.0.0.1:11434", model="llama3.2", engine="ollama").engine is Engine.OLLAMA


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"error": {"message": "unable to load full model on GPU", "type": "api_error"}}', None),
        (b'{"error": "model runner has unexpectedly stopped."}', "model runner has unexpectedly stopped"),
        (b'{"error": {"message": "line one\\nforged line", "type": "api_error"}}', "line one\\x0aforged line"),
        (b'{"error": {"message": "' + b"x" * 500 + b'"}}', "x" * 200 + "…"),
        (b"<html>502 Bad Gateway</html>", "-"),
        (b'{"error": {"code": 500}}', "-"),
        (b'{"error": ""}', "-"),
        (b"[1, 2]", "-"),
    ],
)
def test_a_nodes_own_reason_is_read_from_its_error_answer_escaped_and_bounded(body: bytes, reason: str | None) -> None:
    expected = "unable to load full model on GPU" if reason is None else None if reason == "-" else reason
    assert node_error_reason(body) == expected


@pytest.mark.parametrize(
    ("reason", "loading"),
    [
        ("unable to load full model on GPU", True),
        ("Model runner has unexpectedly stopped, this may be due to resource limitations", True),
        ("llama runner process has terminated: exit status 2", True),
        ("tokenizer: insufficient memory for request?", False),
        ('model "x" not found, try pulling it first', False),
        ("", False),
        (None, False),
    ],
)
def test_a_load_failure_is_known_by_ollamas_own_phrases(reason: str | None, loading: bool) -> None:
    assert is_load_failure(reason) is loading
