"""Helpers for failover tests: what a backend received, a chat body, and a node held busy so
least-connections tries another node first."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from tests.support.daemon import Daemon
from tests.support.fault_backend import FaultBackend, Hang

__all__ = ["CHAT", "body", "busy", "calls"]

CHAT = "/v1/chat/completions"


def calls(backend: FaultBackend) -> int:
    """Inference requests the backend received (health probes left out)."""
    return sum(1 for r in backend.requests if r.path.startswith("/v1/"))


def body(model: str, **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


_HOLD = {"messages": [{"role": "user", "content": "hold this node"}]}


@contextmanager
def busy(daemon: Daemon, backend: FaultBackend, model: str) -> Iterator[None]:
    """Hold one request on `backend` so least-connections sends the next request elsewhere first. It asks
    something no test asks, so prefix affinity (the default policy) knows nothing of the next request's
    prefix and leaves the choice to least-connections."""
    backend.push(Hang())
    before = len(backend.requests)
    client = httpx.Client(trust_env=False, timeout=30)
    thread = threading.Thread(
        target=lambda: _quietly(lambda: client.post(daemon.url + CHAT, json=_HOLD | {"model": model})), daemon=True
    )
    thread.start()
    backend.wait_for_requests(before + 1)
    try:
        yield
    finally:
        client.close()
        thread.join(10)


def _quietly(fn: Callable[[], object]) -> None:
    try:
        fn()
    except httpx.HTTPError:
        pass
