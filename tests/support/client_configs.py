"""Read a generated coding-agent config back the way its agent does: the base URL, the model id and the key it
would send, with each agent's own rule for an environment-variable key.

- OpenCode substitutes `{env:NAME}` with the variable's value, or nothing when it is unset.
- Pi and OMP read `apiKey` as a variable's name when that variable is set, else as the key itself.
- Continue substitutes `${{ secrets.NAME }}` from its `.env` files (the test passes them as `env`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from qiip_core.clientconfig import ClientKind

__all__ = ["ReadBack", "read_back"]


@dataclass(frozen=True)
class ReadBack:
    """What an agent would use from its config."""

    base_url: str
    model: str
    api_key: str
    context_tokens: int | None
    max_output_tokens: int | None


def _only(mapping: Mapping[str, Any]) -> tuple[str, Any]:
    assert len(mapping) == 1, mapping
    return next(iter(mapping.items()))


def read_back(kind: ClientKind, text: str, env: Mapping[str, str] | None = None) -> ReadBack:
    """Parse `text` as `kind`'s file and resolve its key against `env`."""
    env = env or {}
    if kind is ClientKind.OPENCODE:
        document = json.loads(text)
        assert document["$schema"] == "https://opencode.ai/config.json"
        provider_id, provider = _only(document["provider"])
        assert provider["npm"] == "@ai-sdk/openai-compatible"
        chosen_provider, _, model = document["model"].partition("/")
        assert chosen_provider == provider_id
        entry = provider["models"][model]
        raw = provider["options"]["apiKey"]
        found = re.fullmatch(r"\{env:([A-Za-z_][A-Za-z0-9_]*)\}", raw)
        key = env.get(found.group(1), "") if found else raw
        limit = entry.get("limit", {})
        return ReadBack(provider["options"]["baseURL"], model, key, limit.get("context"), limit.get("output"))
    if kind in (ClientKind.PI, ClientKind.OMP):
        document = json.loads(text) if kind is ClientKind.PI else yaml.safe_load(text)
        assert set(document) == {"providers"}  # OMP refuses any other root key
        _, provider = _only(document["providers"])
        assert provider["api"] == "openai-completions"
        (entry,) = provider["models"]
        raw = provider["apiKey"]
        key = env.get(raw) or raw
        return ReadBack(provider["baseUrl"], entry["id"], key, entry.get("contextWindow"), entry.get("maxTokens"))
    document = yaml.safe_load(text)
    assert document["schema"] == "v1" and document["name"] and document["version"]
    (entry,) = document["models"]
    assert entry["provider"] == "openai" and "chat" in entry["roles"]
    raw = entry["apiKey"]
    found = re.fullmatch(r"\$\{\{\s*secrets\.([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", raw)
    key = env[found.group(1)] if found else raw
    options = entry.get("defaultCompletionOptions", {})
    return ReadBack(entry["apiBase"], entry["model"], key, options.get("contextLength"), options.get("maxTokens"))
