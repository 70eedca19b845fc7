"""Helpers for failover tests: what a backend received, a chat body, and a node held busy so
least-connections tries another node first."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from tests.support.daemon import Daemon
from tests.support.fault_backend import FaultBackend, Trickle

__all__ = ["CHAT", "body", "busy", "calls"]

CHAT = "/v1/chat/completions"


def calls(backend: FaultBackend) -> int:
    """Inference requests the backend received (health probes left out)."""
    return sum(1 for r in backend.requests if r.path.startswith("/v1/"))


def body(model: str, **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


_HOLD = {"messages": [{"role": "user", "content": "hold this node"}], "stream": True}


@contextmanager
def busy(daemon: Daemon, backend: FaultBackend, model: str) -> Iterator[None]:
    """Hold one request on `backend` for the whole `with` block, so least-connections sends the next request
    elsewhere first. It asks something no test asks, so prefix affinity (the default policy) knows nothing of the
    next request's prefix and leaves the choice to least-connections.

    The held request is a stream that sends a token every 0.1 s until the block ends, so no first-token or idle
    limit of the gateway ends it, however slow the machine; on leaving the block normally, a hold that ended
    early anyway (a request deadline) fails the test, which would otherwise have checked nothing.

    Raises:
        TimeoutError: the held request did not reach `backend` within 30 s.
        AssertionError: the held request ended before the block did.
    """
    release = threading.Event()
    backend.push(Trickle(gate=release))
    before = sum(1 for record in backend.requests if record.path.split("?", 1)[0] == CHAT)
    client = httpx.Client(trust_env=False, timeout=60)
    answer: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: _quietly(lambda: answer.append(client.post(daemon.url + CHAT, json=_HOLD | {"model": model}))),
        daemon=True,
    )
    thread.start()
    # Health probes arrive meanwhile: count inference requests only.
    backend.wait_for_requests(before + 1, timeout_s=30, path=CHAT)
    try:
        yield
        held_throughout = thread.is_alive()
    finally:
        release.set()
        thread.join(30)
        client.close()
    assert held_throughout, f"The request holding {backend} busy ended early: {answer[0].text[-300:] if answer else ''}"


def _quietly(fn: Callable[[], object]) -> None:
    try:
        fn()
    except httpx.HTTPError:
        pass
