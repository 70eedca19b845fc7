"""`first_violation`: the one reading of a failed validation's first error, for every reader of pydantic's errors."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from qiip_core._violation import Violation, first_violation


class _Gpu(BaseModel):
    model_config = ConfigDict(extra="forbid")
    memory_mib: int

    @field_validator("memory_mib")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("memory_mib must be positive")
        return value


class _Host(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    gpus: list[_Gpu] = []


def _refusal(data: object) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        _Host.model_validate(data)
    return caught.value


def test_a_nested_field_reads_as_its_dotted_path_and_a_validators_own_message() -> None:
    violation = first_violation(_refusal({"name": "h", "gpus": [{"memory_mib": 0}]}))
    assert violation == Violation("gpus.0.memory_mib", "memory_mib must be positive", "value_error")


@pytest.mark.parametrize(
    ("data", "field", "kind"),
    [({}, "name", "missing"), ({"name": "h", "colour": 1}, "colour", "extra_forbidden"), ([], "", "model_type")],
)
def test_the_kind_of_fault_comes_with_the_field(data: object, field: str, kind: str) -> None:
    violation = first_violation(_refusal(data))
    assert (violation.field, violation.kind) == (field, kind)
    assert not violation.message.startswith("Value error")


def test_a_request_error_drops_where_the_value_came_from() -> None:
    exc = RequestValidationError([{"loc": ("body", "messages", 0), "msg": "Field required", "type": "missing"}])
    assert first_violation(exc, skip=1) == Violation("messages.0", "Field required", "missing")


def test_no_error_at_all_reads_as_the_whole_value_at_fault() -> None:
    assert first_violation(RequestValidationError([])).field == ""
