"""One reading of a request body: JSON that every parser on the path reads the same way, or a refusal.

The gateway parses a client's body to authorize and route it (its `model`, `stream`, `max_tokens`), then forwards
the client's bytes to a node or an attached server, which parses them again: llama.cpp with nlohmann::json, vLLM
with pydantic, Ollama with Go's encoding/json, a hosted API with whatever it runs. Python's `json` accepts, and
reads one way, constructs that other parsers refuse or read another way. `strict_loads` refuses each of them,
naming it, so the body the gateway checked is the body the node acts on:

- a body that is not UTF-8 (RFC 8259 §8.1): a byte order mark, NUL bytes (UTF-16 or UTF-32 text), or invalid
  UTF-8 — `json.loads` on bytes guesses UTF-16 or UTF-32 and decodes them, a node reads the raw bytes;
- a key twice in one object, spelled alike or with `\\u` escapes (RFC 8259 §4: "names SHOULD be unique"); parsers
  keep the first, the last, or refuse;
- a top-level member spelled, in another case, like one the gateway reads (`Model`, `STREAM`, `ſtream`): Go's
  encoding/json matches member names to fields without regard to case (Unicode simple folding), so Ollama would
  read it as `model` where the gateway saw no such member;
- `NaN`, `Infinity` and `-Infinity`, which are not JSON (RFC 8259 §6);
- a number too large for a double (`1e400`: Python reads infinity, Go refuses, nlohmann::json keeps infinity; an
  integer of 309 digits: Python keeps it exactly, Go refuses, nlohmann::json reads infinity);
- a `\\u` escape of half a surrogate pair (`"\\ud800"`): Python keeps the lone surrogate, nlohmann::json refuses
  the body, Go reads U+FFFD (RFC 8259 §8.2: such strings' behaviour is unpredictable).

Unescaped control characters, trailing data and bad escapes are refused by `json` itself (its strict mode).
Nesting deeper than the interpreter's recursion limit raises `RecursionError`, which the caller turns into a
refusal.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

__all__ = ["GATEWAY_FIELDS", "NotOneReading", "strict_loads"]

GATEWAY_FIELDS = frozenset({"model", "stream", "max_tokens", "max_completion_tokens", "messages", "prompt"})
"""The top-level members the gateway reads (to authorize, route, bound or hash a request); none may appear spelled in
another case."""

_FOLDED_FIELDS = {name.casefold(): name for name in GATEWAY_FIELDS}

_BOM = b"\xef\xbb\xbf"

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A `\\u` escape of a UTF-16 surrogate (U+D800 to U+DFFF), in a pair or alone: the strings are checked after."""

_ESCAPED_PAIR = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")
"""A high surrogate's escape followed by a low one's: one character, read alike by every parser."""

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
"""A surrogate left in a decoded string: `json` joins an escaped pair into one character, so what is left was
alone."""


class NotOneReading(ValueError):
    """A request body that parsers may read differently (or not at all); its message names the construct.

    Args:
        construct: what the body holds, as a clause ("it holds the key 'model' twice in one object").
    """

    def __init__(self, construct: str) -> None:
        super().__init__(construct)
        self.construct = construct


def _shown(text: str) -> str:
    """A client's string, quoted, escaped to ASCII and cut to 40 characters: safe in an answer and in a log."""
    return ascii(text[:40]) + ("…" if len(text) > 40 else "")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`object_pairs_hook`: one object's members in order, refused when a key appears twice."""
    members = dict(pairs)
    if len(members) != len(pairs):
        seen: set[str] = set()
        for key, _value in pairs:
            if key in seen:
                raise NotOneReading(f"it holds the key {_shown(key)} twice in one object")
            seen.add(key)
    return members


def _constant(name: str) -> Any:
    """`parse_constant`: `NaN`, `Infinity` and `-Infinity`, never JSON."""
    raise NotOneReading(f"it holds {name}, which is not a JSON number (RFC 8259 §6)")


def _float(text: str) -> float:
    """`parse_float`: a number with a fraction or an exponent, refused past a double's range."""
    value = float(text)
    if math.isinf(value):
        raise NotOneReading(f"it holds the number {_shown(text)}, too large for a double")
    return value


def _int(text: str) -> int:
    """`parse_int` (only for a body with a run of 309 digits, `_LONG_RUN`): an integer past a double's range is
    refused (Python keeps it exactly, Go refuses it, nlohmann::json reads infinity)."""
    value = int(text)
    if abs(value) > sys.float_info.max:
        raise NotOneReading(f"it holds the number {_shown(text)}, too large for a double")
    return value


_DECODER = json.JSONDecoder(object_pairs_hook=_object, parse_constant=_constant, parse_float=_float)
_EXACT_DECODER = json.JSONDecoder(
    object_pairs_hook=_object, parse_constant=_constant, parse_float=_float, parse_int=_int
)
_DIGITS_AS_ZERO = bytes(48 if 48 <= c <= 57 else 32 for c in range(256))
"""`bytes.translate` table: every digit becomes `0`, every other byte a space."""
_LONG_RUN = b"0" * 309
"""As many digits in a row as the smallest integer past a double's range has (10**308 is within it, 2**1024 is
not): only a body holding such a run pays a Python call per integer. Found with a translation and a substring
search, both in C (a regular expression of a counted repeat took longer than the parse)."""


def _long_digit_run(body: bytes) -> bool:
    """Whether `body` holds 309 digits in a row (anywhere: in a number or in a string)."""
    return len(body) >= len(_LONG_RUN) and _LONG_RUN in body.translate(_DIGITS_AS_ZERO)


def strict_loads(body: bytes) -> object:
    """Parse a request body that every parser reads the same way (see the module's list of what is refused).

    Args:
        body: the request's bytes, as the client sent them (and as they are forwarded).

    Returns:
        The parsed value: dicts, lists, strings, ints, floats, booleans and None.

    Raises:
        NotOneReading: a construct parsers read differently, named in its message.
        ValueError: (`json.JSONDecodeError`) the body is not JSON.
        RecursionError: nested deeper than the interpreter's recursion limit.
    """
    if body.startswith(_BOM):
        raise NotOneReading(
            "it starts with a byte order mark; JSON between systems is UTF-8 without one (RFC 8259 §8.1)"
        )
    if b"\x00" in body:
        raise NotOneReading(
            "it holds NUL bytes (UTF-16 or UTF-32 text?); JSON between systems is UTF-8 (RFC 8259 §8.1)"
        )
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotOneReading(
            f"it is not UTF-8 (at byte {exc.start}); JSON between systems is UTF-8 (RFC 8259 §8.1)"
        ) from None
    value = (_EXACT_DECODER if _long_digit_run(body) else _DECODER).decode(text)
    if isinstance(value, dict):
        for key in value:
            if key not in GATEWAY_FIELDS and (name := _FOLDED_FIELDS.get(key.casefold())) is not None:
                raise NotOneReading(
                    f"it holds the member {_shown(key)}, which some parsers read as `{name}` (names are matched "
                    "without regard to case)"
                )
    if _SURROGATE_ESCAPE.search(body) is not None and _lone_surrogate_escape(body):
        _check_strings(value)
    return value


def _lone_surrogate_escape(body: bytes) -> bool:
    """Whether `body` may hold a surrogate escape outside a pair: escaped backslashes go first, each replaced by a NUL
    (never in a body that got here), so `\\\\ud83d` is text, not an escape, and the escapes on either side of one
    never join into a pair; then every escaped pair; any surrogate escape left sends the strings to the exact check."""
    return _SURROGATE_ESCAPE.search(_ESCAPED_PAIR.sub(b"", body.replace(b"\\\\", b"\x00"))) is not None


def _check_strings(value: object) -> None:
    """Refuse a lone surrogate in any key or string of `value` (iteratively: nesting is bounded by the parse)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            strings: list[str] = [item]
        elif isinstance(item, dict):
            strings = list(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
            continue
        else:
            continue
        for text in strings:
            if _LONE_SURROGATE.search(text) is not None:
                raise NotOneReading(
                    "it holds a \\u escape of half a surrogate pair, which parsers read differently (RFC 8259 §8.2)"
                )
