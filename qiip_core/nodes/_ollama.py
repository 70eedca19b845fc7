"""What QIIP reads from an Ollama server's native API, and how it reads it.

An Ollama node serves QIIP's clients on Ollama's OpenAI-compatible routes (`/v1/chat/completions`,
`/v1/completions`, `/v1/embeddings`, `/v1/models`), which the gateway forwards as for any node. Its health and
what it holds in memory come from the native routes (ollama/ollama `docs/api.md`, `api/types.go`):

```
GET /api/version   {"version": "0.9.6"}                          the server's release (`OLLAMA_MIN_VERSION`)
GET /api/tags      {"models": [{"name": "llama3.2:3b", …}]}      the models it has (`listed_models`)
GET /api/ps        {"models": [{"name", "size", "size_vram",     the models loaded now, with their memory
                    "context_length", "expires_at", …}]}          (`resident_models`)
```

Each reader takes the decoded JSON body and either returns what it found or raises `ValueError` with one line
saying what the server answered instead, which the health checker shows as the node's last error.

Model names: Ollama names a model `name:tag` and calls a name without a tag `name:latest`
(`ollama_model_key`), so a node registered as `llama3.2` serves what the server lists as `llama3.2:latest`.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MAX_RESIDENT",
    "OLLAMA_LOAD_FAILURES",
    "OLLAMA_MIN_VERSION",
    "ResidentModel",
    "check_ollama_version",
    "is_load_failure",
    "listed_models",
    "ollama_model_key",
    "resident_models",
]

OLLAMA_MIN_VERSION = (0, 6, 0)
"""The oldest Ollama release QIIP serves: the first with every route it uses (`/v1/embeddings`, `/api/ps` with
`size_vram`, and `/api/create` from blobs with `files`)."""

OLLAMA_LOAD_FAILURES = (
    "unable to load full model on GPU",
    "model requires more system memory",
    "model runner has unexpectedly stopped",
    "llama runner process has terminated",
)
"""How an Ollama server says it could not load a model it has (`llm.ErrLoadRequiredFull`, the runner's exits):
the start of its error message on a 500."""

_VERSION = re.compile(r"v?([0-9]+)\.([0-9]+)\.([0-9]+)(?:[-+][0-9A-Za-z.+-]*)?")

MAX_RESIDENT = 64
"""The most loaded models read from one `/api/ps` answer; the rest are dropped (a server loads
`OLLAMA_MAX_LOADED_MODELS`, three per GPU by default), so a server cannot make the daemon keep and export more."""

_MAX_COUNT = (1 << 63) - 1
"""Go's int64, the type of Ollama's sizes: a larger number is not a size (and would not fit a float)."""

_MAX_NAME_CHARS = 512
"""A model name longer than this in an answer is not one (a real name is well under 100 characters)."""


class ResidentModel(BaseModel):
    """A model an Ollama server holds in memory now, as `GET /api/ps` lists it (`api.ProcessModelResponse`).

    Attributes:
        name: the model's name with its tag (`llama3.2:3b`).
        size_bytes: the memory it takes in all, weights and KV cache (`size`).
        vram_bytes: the part of it in GPU memory (`size_vram`); below `size_bytes`, the rest runs on the CPU.
        context_length: the context it was loaded with, in tokens (`context_length`; None from a server too old
            to say).
        expires_at: when the server unloads it unless a request keeps it (`expires_at`; None when it stays).
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str = Field(min_length=1, max_length=_MAX_NAME_CHARS)
    size_bytes: int = Field(ge=0, le=_MAX_COUNT)
    vram_bytes: int = Field(ge=0, le=_MAX_COUNT)
    context_length: int | None = Field(default=None, ge=0, le=_MAX_COUNT)
    expires_at: datetime | None = None


def ollama_model_key(name: str) -> str:
    """The name Ollama files `name` under: `name:latest` when it has no tag (Ollama's `model.ParseName`).

    Args:
        name: a model name as a client or a registration gives it (`llama3.2`, `llama3.2:3b`,
            `registry.example/org/model:q4`).

    Returns:
        The name with its tag; a tag is what follows the last `:` after the last `/`.
    """
    tail = name.rsplit("/", 1)[-1]
    return name if ":" in tail else f"{name}:latest"


def is_load_failure(reason: str | None) -> bool:
    """Whether a node's error message says it could not load the model (`OLLAMA_LOAD_FAILURES`).

    Args:
        reason: the message of the node's error answer, or None.

    Returns:
        True when it starts with one of the known phrases, in any case.
    """
    lowered = (reason or "").lower()
    return any(lowered.startswith(phrase.lower()) for phrase in OLLAMA_LOAD_FAILURES)


def check_ollama_version(body: Any) -> str:
    """Read `GET /api/version` and check the release is one QIIP serves.

    Args:
        body: the decoded JSON answer.

    Returns:
        The version as the server reports it (`0.9.6`, `0.9.7-rc1`).

    Raises:
        ValueError: the answer is not `{"version": "X.Y.Z"}`, or the release is older than `OLLAMA_MIN_VERSION`
            (a development build reports `0.0.0`, and is refused as too old).
    """
    version = body.get("version") if isinstance(body, dict) else None
    match = _VERSION.fullmatch(version) if isinstance(version, str) and len(version) <= 64 else None
    if match is None:
        raise ValueError('GET /api/version did not answer an Ollama version ({"version": "X.Y.Z"})')
    found = tuple(int(part) for part in match.groups())
    if found < OLLAMA_MIN_VERSION:
        oldest = ".".join(map(str, OLLAMA_MIN_VERSION))
        raise ValueError(f"Ollama {version} is older than {oldest}, the oldest release QIIP serves")
    return str(version)


def listed_models(body: Any) -> frozenset[str]:
    """Read `GET /api/tags`: the names (with their tags) of the models the server has.

    Args:
        body: the decoded JSON answer.

    Returns:
        Each model's `name` and `model` (the same in current releases), keyed as `ollama_model_key` does.

    Raises:
        ValueError: the answer is not `{"models": [{"name": …}, …]}`.
    """
    return frozenset(ollama_model_key(name) for entry in _models(body, "GET /api/tags") for name in _names(entry))


def resident_models(body: Any) -> tuple[ResidentModel, ...]:
    """Read `GET /api/ps`: the models loaded now and their memory, in the server's order.

    Args:
        body: the decoded JSON answer.

    Returns:
        One `ResidentModel` per readable entry, each name once, at most `MAX_RESIDENT`. An entry without a
        printable name, or whose sizes are not counts of bytes below 2**63 (Go's int64), is skipped: it cannot be
        the model of a node, and one such entry does not hide the others.

    Raises:
        ValueError: the answer is not `{"models": [...]}`.
    """
    resident: dict[str, ResidentModel] = {}
    for entry in _models(body, "GET /api/ps"):
        names = _names(entry)
        size, vram = entry.get("size"), entry.get("size_vram")
        if not names or not _is_count(size) or not _is_count(vram) or names[0] in resident:
            continue
        context = entry.get("context_length")
        resident[names[0]] = ResidentModel(
            name=names[0],
            size_bytes=size,
            vram_bytes=vram,
            context_length=context if _is_count(context) else None,
            expires_at=_timestamp(entry.get("expires_at")),
        )
        if len(resident) == MAX_RESIDENT:
            break
    return tuple(resident.values())


def _models(body: Any, route: str) -> list[dict[str, Any]]:
    models = body.get("models") if isinstance(body, dict) else None
    if not isinstance(models, list) or not all(isinstance(entry, dict) for entry in models):
        raise ValueError(f'{route} did not answer a model list ({{"models": [...]}})')
    return models


def _names(entry: dict[str, Any]) -> list[str]:
    return [
        value
        for value in (entry.get("name"), entry.get("model"))
        if isinstance(value, str) and 0 < len(value) <= _MAX_NAME_CHARS and value.isprintable()
    ]


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_COUNT


def _timestamp(value: Any) -> datetime | None:
    # Go's zero time (`0001-01-01T00:00:00Z`) and anything unreadable mean no expiry is known.
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    return None if moment.year <= 1 else moment
