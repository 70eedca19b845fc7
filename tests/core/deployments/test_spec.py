"""A deployment's spec, checked field by field before anything is stored: every refusal names its field."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from qiip_core import DeploymentInvalid
from qiip_core.deployments import Template, parse_spec
from qiip_core.nodes import Engine

GOOD: dict[str, Any] = {"name": "coder", "source": {"artifact": "4f1c2b8e"}}


def refusal(**changes: Any) -> DeploymentInvalid:
    with pytest.raises(DeploymentInvalid) as caught:
        parse_spec({**GOOD, **changes})
    return caught.value


def test_the_smallest_deployment_takes_every_default() -> None:
    spec = parse_spec(GOOD)
    assert (spec.engine, spec.replicas, spec.update.max_surge, spec.update.max_unavailable) == ("llama_cpp", 1, 1, 0)
    assert spec.runtime.policy().sizing == "auto"
    assert spec.autoscale.mode == "off"


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"name": "bad name"}, "name", "1-128 letters"),
        ({"name": "x\n"}, "name", "1-128 letters"),
        ({"replicas": -1}, "replicas", "greater than or equal to 0"),
        ({"replicas": "3"}, "replicas", "valid integer"),
        ({"engine": "tgi"}, "engine", "'llama_cpp', 'vllm' or 'ollama'"),
        ({"engine": "ollama", "name": "qwen@8b"}, "deployment", "name on Ollama"),
        ({"colour": "red"}, "colour", "not a deployment field"),
        ({"source": {"artifact": "4f1c"}}, "source.artifact", "at least 8 lowercase hex"),
        ({"source": {}}, "source", "exactly one of artifact and hub"),
        ({"source": {"artifact": "4f1c2b8e", "hub": {"repo": "a/b", "file": "x.gguf"}}}, "source", "exactly one"),
        ({"source": {"hub": {"repo": "a/b", "file": "../../etc/passwd"}}}, "source.hub.file", "no '..'"),
        (
            {"source": {"hub": {"repo": "a/b", "file": "x.gguf", "revision": "main/../../x"}}},
            "source.hub.revision",
            "no '..'",
        ),
        ({"source": {"hub": {"repo": "--trust-remote-code", "file": "x.gguf"}}}, "source.hub.repo", "org/name"),
        ({"source": {"hub": {"repo": "a/b"}}}, "deployment", "source.hub.file is required for llama.cpp"),
        ({"runtime": {"sizing": {"sizing": "custom", "slots": 0}}}, "runtime.sizing", "required"),
        (
            {"runtime": {"capacity": {"sequences": 0, "context_tokens": 4096}}},
            "runtime.capacity.sequences",
            "greater than",
        ),
        (
            {"runtime": {"sizing": {"sizing": "auto"}, "capacity": {"sequences": 1, "context_tokens": 4096}}},
            "runtime",
            "at most one",
        ),
        ({"placement": {"hosts": ["a b"]}}, "placement", "host pattern"),
        ({"placement": {"labels": {"bad key!": "x"}}}, "placement", "label key"),
        ({"placement": {"min_gpu_memory_mib": 0}}, "placement.min_gpu_memory_mib", "greater than or equal to 1"),
        ({"update": {"max_surge": 0, "max_unavailable": 0}}, "update", "never progress"),
        ({"autoscale": {"min": 3, "max": 2}}, "autoscale", "min (3) is above max (2)"),
        ({"autoscale": {"mode": "turbo"}}, "autoscale.mode", "'off', 'recommend' or 'active'"),
    ],
)
def test_every_broken_field_is_refused_with_its_name_and_the_rule(
    changes: dict[str, Any], field: str, words: str
) -> None:
    error = refusal(**changes)
    assert error.violations[0].field.startswith(field), error.violations
    assert words in error.message, error.message
    assert error.status == 422 and error.param == error.violations[0].field


def test_vllm_takes_a_hub_repository_and_no_gguf_sizing() -> None:
    spec = parse_spec({"name": "q", "engine": "vllm", "source": {"hub": {"repo": "Qwen/Qwen3-8B"}}})
    assert spec.source.hub is not None and spec.source.hub.revision == "main"
    assert "vLLM does not serve" in refusal(engine="vllm").message
    error = refusal(engine="vllm", source={"hub": {"repo": "a/b"}}, runtime={"sizing": {"sizing": "auto"}})
    assert "vLLM sizes itself" in error.message


def test_a_template_stored_before_reads_back_the_same_and_keeps_its_hash() -> None:
    stored = '{"engine":"vllm","source":{"model":"org/m","artifact_id":null,"revision":null,"describe":""}}'
    template = Template.model_validate_json(stored)
    assert template.engine is Engine.VLLM
    assert template.model_dump_json(include={"engine", "source"}) == stored
    body: dict[str, Any] = {"engine": "vllm", "model": "org/m", "artifact_id": None, "revision": None, "runtime": {}}
    written = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]
    assert template.hash == written
