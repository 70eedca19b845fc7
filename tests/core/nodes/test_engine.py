"""The engines QIIP provisions, as a field of the setup body, the deployment spec and the stored template."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from qiip_core.nodes import PROVISIONED_ENGINES, Engine, ProvisionedEngine


class _Body(BaseModel):
    engine: ProvisionedEngine


def test_a_provisioned_engine_is_read_from_its_value_and_written_as_it() -> None:
    assert PROVISIONED_ENGINES == (Engine.LLAMA_CPP, Engine.VLLM, Engine.OLLAMA)
    assert _Body.model_validate_json('{"engine": "ollama"}').engine is Engine.OLLAMA
    body = _Body.model_validate_json('{"engine": "vllm"}')
    assert body.engine is Engine.VLLM and body.model_dump_json() == '{"engine":"vllm"}'
    assert _Body(engine=Engine.LLAMA_CPP).engine is Engine.LLAMA_CPP
    assert _Body.model_json_schema()["properties"]["engine"]["enum"] == ["llama_cpp", "vllm", "ollama"]


@pytest.mark.parametrize("given", ['"tgi"', '"attached"', '"LLAMA_CPP"', "null", "5", "[1]"])
def test_anything_else_is_refused_in_one_line_naming_the_values(given: str) -> None:
    with pytest.raises(ValidationError) as caught:
        _Body.model_validate_json(f'{{"engine": {given}}}')
    (error,) = caught.value.errors()
    assert (error["loc"], error["msg"]) == (("engine",), "Input should be 'llama_cpp', 'vllm' or 'ollama'")
