"""What the end-to-end deployment tests drive and read through a real daemon: a client loop counting every answer
by status, a deployment's view, and whether it settled on its current template."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.daemon import Daemon, wait_until

__all__ = ["ClientLoop", "deployment", "ready_hosts", "settled", "status_of"]


@dataclass
class ClientLoop:
    """Requests through the gateway one after another on each of `threads` threads (resting `pause_s` between
    two), counting every answer by status."""

    url: str
    model: str
    threads: int = 1
    max_tokens: int = 4
    pause_s: float = 0.0
    """Seconds each thread rests between requests (a light load)."""
    statuses: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> ClientLoop:
        def run() -> None:
            with httpx.Client(base_url=self.url, timeout=60, trust_env=False) as client:
                while not self._stop.is_set():
                    body = {
                        "model": self.model,
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": self.max_tokens,
                    }
                    error = None
                    try:
                        answer = client.post("/v1/chat/completions", json=body)
                        status = answer.status_code
                        if status != 200:
                            error = answer.text[:300]
                    except httpx.HTTPError as exc:
                        status, error = 0, repr(exc)
                    with self._lock:
                        self.statuses[status] = self.statuses.get(status, 0) + 1
                        if error is not None:
                            self.errors.append(error)
                    self._stop.wait(self.pause_s)

        self._threads = [threading.Thread(target=run, daemon=True) for _ in range(self.threads)]
        for thread in self._threads:
            thread.start()
        wait_until(lambda: self.statuses.get(200, 0) >= 3, 60, "the client loop's first answers")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    @property
    def failed(self) -> int:
        return sum(n for status, n in self.statuses.items() if status != 200)


def deployment(daemon: Daemon, name: str) -> dict[str, Any]:
    """`GET /admin/deployments/NAME` (asserted 200)."""
    answer = daemon.admin.get(f"/admin/deployments/{name}")
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def status_of(daemon: Daemon, name: str) -> dict[str, Any]:
    """The deployment's stored status (empty before the controller wrote one)."""
    return deployment(daemon, name).get("status") or {}


def ready_hosts(daemon: Daemon, name: str, template: str | None = None) -> set[str]:
    """The hosts of the deployment's ready replicas (of `template` when given)."""
    return {
        r["host"]
        for r in status_of(daemon, name).get("replicas", [])
        if r["state"] == "ready" and (template is None or r["template"] == template)
    }


def settled(daemon: Daemon, name: str, replicas: int) -> bool:
    """`replicas` replicas of the current template ready and nothing else left."""
    view = deployment(daemon, name)
    status = view.get("status") or {}
    current = view["template"]["hash"]
    kept = status.get("replicas", [])
    return (
        status.get("observed_generation") == view["generation"]
        and len(kept) == replicas
        and all(r["state"] == "ready" and r["template"] == current for r in kept)
    )
