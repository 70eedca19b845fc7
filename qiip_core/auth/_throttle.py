"""Failed authentications per client address: the throttle in front of every credential check.

A client that keeps presenting wrong credentials (admin passwords, invoke tokens, an agent's bearer token) is
refused for a while instead of being answered as fast as it can guess. Only credentials that were presented and
wrong count: a request that presents none (a first page load, a probe) is refused without counting, so harmless
clients never lock an address out.
"""

from __future__ import annotations

import time
from collections import OrderedDict

__all__ = ["AuthThrottle"]


class AuthThrottle:
    """Failed authentications per peer address, over a sliding window: past `burst` failures within
    `window_s`, the peer's requests are refused until its oldest failure leaves the window.

    Args:
        burst: failures a peer may have within `window_s` before it is refused.
        window_s: the window, in seconds.
        max_peers: peers remembered at most (the least recently failed are forgotten first).
    """

    def __init__(self, *, burst: int = 10, window_s: float = 60.0, max_peers: int = 10_000) -> None:
        self.burst = burst
        self.window_s = window_s
        self.max_peers = max_peers
        self._failures: OrderedDict[str, list[float]] = OrderedDict()
        self.recorded: list[str] | None = None
        """With several serving processes (`server.workers`): the peers of the failures `failed` recorded since
        the last `take_recorded`, for the other processes to `learn`; None (the default): not kept."""

    def retry_after_s(self, peer: str) -> float | None:
        """Seconds until `peer` may try again, or None when it may now."""
        failures = self._failures.get(peer)
        if failures is None:
            return None
        now = time.monotonic()
        while failures and failures[0] <= now - self.window_s:
            failures.pop(0)
        if not failures:
            del self._failures[peer]
            return None
        if len(failures) < self.burst:
            return None
        return failures[-self.burst] + self.window_s - now

    def failed(self, peer: str) -> None:
        """Record one failed authentication from `peer` (credentials presented and wrong)."""
        if self.recorded is not None:
            self.recorded.append(peer)
        self.learn(peer)

    def learn(self, peer: str) -> None:
        """Record one failed authentication from `peer` that another serving process saw (`failed` without
        keeping it for the others)."""
        failures = self._failures.pop(peer, None) or []
        failures.append(time.monotonic())
        del failures[: -self.burst]
        self._failures[peer] = failures
        while len(self._failures) > self.max_peers:
            self._failures.popitem(last=False)

    def take_recorded(self) -> list[str]:
        """The peers `failed` recorded since the last call (empty when not kept)."""
        recorded = self.recorded
        if not recorded:
            return []
        self.recorded = []
        return recorded
