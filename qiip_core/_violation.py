"""`Violation`: one rule a sizing policy breaks, as `PlanError.violations` carries it.

It lives below both the error tree (`_errors`) and the planner (`qiip_core.planner`, which exports it and is where
callers import it from), so that the error tree can name it without importing the planner: the planner imports
the error tree, never the reverse.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["FieldNames", "ValidationErrors", "Violation", "first_violation", "offers", "spell", "spell_setting"]

FieldNames = Mapping[str, str]
"""How a caller spells the fields a message names: field → its name there (a config key, a CLI flag such as
`--ctx-size`). A message composes each field's name from it; a field missing from it is spelled as itself, and
advice to set it is left out (the caller has no way to set it). None: every field as its config key."""


def spell(names: FieldNames | None, field: str) -> str:
    """`field` as the caller spells it (`context_per_slot`, or `--ctx-size` for the CLI)."""
    return field if names is None else names.get(field, field)


def spell_setting(names: FieldNames | None, field: str, value: str) -> str:
    """`field` set to `value` as the caller writes it: a flag takes the value bare (`--cache-type q8_0`), a key
    takes it quoted (`cache_type 'q8_0'`)."""
    name = spell(names, field)
    return f"{name} {value}" if name.startswith("-") else f"{name} {value!r}"


def offers(names: FieldNames | None, field: str) -> bool:
    """Whether advice may tell the caller to set `field`: every field without `names`, else those it names."""
    return names is None or field in names


class ValidationErrors(Protocol):
    """What `first_violation` reads: a failed validation's errors, each a mapping with `loc`, `msg` and `type`
    (pydantic's `ValidationError`, FastAPI's `RequestValidationError`)."""

    def errors(self) -> Sequence[Any]:
        """The errors, first the first found."""
        ...


@dataclass(frozen=True)
class Violation:
    """One rule a policy breaks."""

    field: str
    """The policy field at fault (`context_per_slot`, …)."""
    message: str
    """A full sentence: what is wrong and what is allowed."""
    kind: str = ""
    """pydantic's error type where the rule came from a validation (`missing`, `extra_forbidden`, `value_error`,
    …; `first_violation`), else "": lets a reader pick its advice by the kind of fault."""

    def line(self) -> str:
        """One line naming the field once: the message when it starts with the field (`replicas: …`, `name must
        be …`), else `field: message`."""
        message = " ".join(self.message.split())
        if message == self.field or message.startswith((f"{self.field} ", f"{self.field}:")):
            return message
        return f"{self.field}: {message}"


def first_violation(exc: ValidationErrors, *, skip: int = 0) -> Violation:
    """The first error of a pydantic validation, as a `Violation`: the one place a refusal's field and reason are
    read from pydantic, for the daemon's routes, the core's readers, the CLI and the console alike.

    Args:
        exc: a validation that failed: pydantic's `ValidationError` or FastAPI's `RequestValidationError` (either
            gives at least one error; none reads as the whole value at fault).
        skip: leading location parts to drop: 1 for a FastAPI request error, whose location starts with where the
            value came from (`body`, `query`).

    Returns:
        Its field as a dotted path (`gpus.0.memory_mib`; "" when the whole value is at fault), pydantic's message
        for it without the `Value error, ` prefix pydantic puts on a validator's own `ValueError` (the rest
        unchanged), and pydantic's error type as `kind`.
    """
    errors = exc.errors()
    if not errors:
        return Violation("", "invalid value", "value_error")
    first = errors[0]
    field = ".".join(str(part) for part in tuple(first["loc"])[skip:])
    return Violation(field, str(first["msg"]).removeprefix("Value error, "), str(first["type"]))
