"""The JSON and OpenAI payloads the behaviours and the server write: compact JSON, errors, events and chunks.

They follow the OpenAI API, so a gateway parses them as it parses a real node's answers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def lower_names(headers: Mapping[str, str] | None) -> dict[str, str]:
    """The headers with their names lower-cased (None is no headers)."""
    return {name.lower(): value for name, value in (headers or {}).items()}


def dumps(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON, without spaces after the separators."""
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def parse_json(body: bytes) -> Any | None:
    """The body parsed as JSON, or None when it is empty or not JSON."""
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """One `data: {...}` event, blank line included."""
    return b"data: " + dumps(payload) + b"\n\n"


def error_body(status: int, message: str, *, error_type: str = "server_error") -> dict[str, Any]:
    """An OpenAI-shaped error object; a 4xx status makes the default type `invalid_request_error`."""
    if 400 <= status < 500 and error_type == "server_error":
        error_type = "invalid_request_error"
    return {"error": {"message": message, "type": error_type, "code": status}}


def envelope(
    completion_id: str,
    object_name: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    *,
    usage: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The fields every completion object and chunk shares, `usage` only when given."""
    body: dict[str, Any] = {
        "id": completion_id,
        "object": object_name,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = dict(usage)
    return body


def chat_chunk(
    completion_id: str,
    model: str,
    created: int,
    *,
    content: str,
    role: str | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """A `chat.completion.chunk` whose delta carries `content` (and `role`, when given)."""
    delta: dict[str, Any] = {"role": role} if role else {}
    delta["content"] = content
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return envelope(completion_id, "chat.completion.chunk", created, model, [choice])


def text_chunk(completion_id: str, model: str, created: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    """A `text_completion` chunk carrying `text`."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return envelope(completion_id, "text_completion", created, model, [choice])
