"""`Violation`: one rule a sizing policy breaks, as `PlanError.violations` carries it.

It lives below both the error tree (`_errors`) and the planner (`qiip_core.planner`, which exports it and is where
callers import it from), so that the error tree can name it without importing the planner: the planner imports
the error tree, never the reverse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError

__all__ = ["FieldNames", "Violation", "first_violation", "offers", "spell", "spell_setting"]

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


@dataclass(frozen=True)
class Violation:
    """One rule a policy breaks."""

    field: str
    """The policy field at fault (`context_per_slot`, …)."""
    message: str
    """A full sentence: what is wrong and what is allowed."""

    def line(self) -> str:
        """One line naming the field once: the message when it starts with the field (`replicas: …`, `name must
        be …`), else `field: message`."""
        message = " ".join(self.message.split())
        if message == self.field or message.startswith((f"{self.field} ", f"{self.field}:")):
            return message
        return f"{self.field}: {message}"


def first_violation(exc: ValidationError) -> Violation:
    """The first error of a pydantic validation, as a `Violation`.

    Args:
        exc: a validation that failed (pydantic gives at least one error).

    Returns:
        Its field as a dotted path (`gpus.0.memory_mib`; "" when the whole value is at fault) and pydantic's
        message for it, unchanged.
    """
    first = exc.errors()[0]
    return Violation(".".join(str(part) for part in first["loc"]), str(first["msg"]))
