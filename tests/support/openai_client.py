"""The `openai` client the tests use, closed when the test ends.

An `openai.OpenAI` keeps its connections open until it is closed; one left to the garbage collector closes its socket
then, with a `ResourceWarning` that lands on whichever test happens to be running (the suite turns warnings into
errors). `openai_client` records each client, and the autouse fixture `close_openai_clients` (tests/conftest.py)
closes them after every test.
"""

from __future__ import annotations

import openai

__all__ = ["close_all", "openai_client"]

_OPEN: list[openai.OpenAI] = []


def openai_client(base_url: str, *, api_key: str = "x", max_retries: int = 0) -> openai.OpenAI:
    """An `openai.OpenAI` for `base_url` (ending in `/v1`), without retries unless asked, closed after the test."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=max_retries)
    _OPEN.append(client)
    return client


def close_all() -> None:
    """Close every client `openai_client` made."""
    while _OPEN:
        _OPEN.pop().close()
