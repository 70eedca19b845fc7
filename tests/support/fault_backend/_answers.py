"""Valid answers: completions, chats and embeddings as a healthy node gives them, streamed or whole.

`Completion()` is the backend's default behaviour, so a test scripts only the faults it is about.
"""

from __future__ import annotations

import base64
import hashlib
import random
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tests.support.fault_backend._exchange import Behaviour, Exchange
from tests.support.fault_backend._payloads import chat_chunk, dumps, envelope, error_body, sse_event, text_chunk
from tests.support.fault_backend._status import Json
from tests.support.fault_backend._stream import Sse


@dataclass(frozen=True)
class Embeddings(Behaviour):
    """A valid OpenAI embeddings response, one deterministic unit vector per input.

    Inputs may be a string, a list of strings, a list of token ids or a list of token-id lists. With
    `"encoding_format": "base64"` (the openai client's default) each vector is little-endian float32 in
    base64. A request without input gets a 400.

    Attributes:
        dim: the vector length.
    """

    dim: int = 8

    async def respond(self, exchange: Exchange) -> None:
        payload = exchange.payload
        raw = payload.get("input")
        if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw)):
            items: list[Any] = [raw]
        elif isinstance(raw, list) and raw:
            items = raw
        else:
            body = error_body(400, "The request needs an 'input'.", error_type="invalid_request_error")
            await Json(400, body).respond(exchange)
            return
        as_base64 = payload.get("encoding_format") == "base64"
        data = []
        for index, item in enumerate(items):
            vector = _unit_vector(item, self.dim)
            embedding: list[float] | str = vector
            if as_base64:
                embedding = base64.b64encode(struct.pack(f"<{self.dim}f", *vector)).decode("ascii")
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        tokens = sum(_count_tokens(item) for item in items)
        body = {
            "object": "list",
            "data": data,
            "model": exchange.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        await Json(200, body).respond(exchange)


@dataclass(frozen=True)
class Completion(Behaviour):
    """A valid answer for whichever inference path was called: the backend's default behaviour.

    `/v1/chat/completions` gets a `chat.completion`, `/v1/completions` a `text_completion`, both with usage
    and the content "tok0 tok1 ...". With `"stream": true` the same content is streamed as in `Sse()` (chunks
    of the matching object type), ending with a usage chunk (`choices: []`) when
    `stream_options.include_usage` is true. `/v1/embeddings` is answered as by `Embeddings()`.

    Attributes:
        n_tokens: how many tokens the completion has.
    """

    n_tokens: int = 5

    async def respond(self, exchange: Exchange) -> None:
        path = exchange.api_path
        if path == "/v1/embeddings":
            await Embeddings().respond(exchange)
            return
        payload = exchange.payload
        chat = path != "/v1/completions"
        completion_id = f"{'chatcmpl' if chat else 'cmpl'}-fault-{exchange.port}-{exchange.serial}"
        created = int(time.time())
        prompt_tokens = _count_prompt_tokens(payload)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.n_tokens,
            "total_tokens": prompt_tokens + self.n_tokens,
        }
        tokens = [f"tok{i} " for i in range(self.n_tokens)]
        if payload.get("stream") is True:
            options = payload.get("stream_options")
            include_usage = isinstance(options, dict) and options.get("include_usage") is True
            chunks = []
            for i, token in enumerate(tokens):
                finish_reason = "stop" if i == len(tokens) - 1 else None
                if chat:
                    role = "assistant" if i == 0 else None
                    chunk = chat_chunk(
                        completion_id, exchange.model, created, content=token, role=role, finish_reason=finish_reason
                    )
                else:
                    chunk = text_chunk(completion_id, exchange.model, created, token, finish_reason)
                if include_usage:
                    chunk["usage"] = None
                chunks.append(chunk)
            if include_usage:
                object_name = "chat.completion.chunk" if chat else "text_completion"
                chunks.append(envelope(completion_id, object_name, created, exchange.model, [], usage=usage))
            await Sse(events=[sse_event(chunk) for chunk in chunks]).respond(exchange)
            return
        content = "".join(tokens)
        if chat:
            message = {"role": "assistant", "content": content}
            choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
            body = envelope(completion_id, "chat.completion", created, exchange.model, [choice], usage=usage)
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": "stop"}
            body = envelope(completion_id, "text_completion", created, exchange.model, [choice], usage=usage)
        await Json(200, body).respond(exchange)


def _count_tokens(value: Any) -> int:
    """A stand-in tokenizer: words in strings, items in token-id lists."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(1 if isinstance(item, int) else _count_tokens(item) for item in value)
    return 0


def _count_prompt_tokens(payload: Mapping[str, Any]) -> int:
    tokens = _count_tokens(payload.get("prompt"))
    messages = payload.get("messages")
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = [part.get("text") for part in content if isinstance(part, dict)]
        tokens += _count_tokens(content)
    return max(tokens, 1)


def _unit_vector(item: Any, dim: int) -> list[float]:
    """A deterministic vector for one input, so equal inputs embed equally."""
    rng = random.Random(hashlib.sha256(dumps(item)).digest())
    vector = [rng.uniform(-1.0, 1.0) for _ in range(dim)]
    norm = sum(x * x for x in vector) ** 0.5 or 1.0
    return [x / norm for x in vector]
