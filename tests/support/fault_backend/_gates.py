"""Delays and gates: a request held until the client gives up, or until the test releases it.

Shorter delays are fields of the other behaviours (`Json.delay_s`, the `Sse` delays); these hold a request for as
long as the test needs, whatever the machine's speed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from tests.support.fault_backend._exchange import Behaviour, Exchange


@dataclass(frozen=True)
class Hang(Behaviour):
    """Read the request and never answer, until the client goes away (which is recorded)."""

    async def respond(self, exchange: Exchange) -> None:
        await exchange.wait_for_client_to_leave()


@dataclass(frozen=True)
class Gated(Behaviour):
    """Hold the request until the test sets `gate`, then answer with `then`.

    For tests that must observe the gateway while a request is in flight, whatever the machine's speed.

    Attributes:
        gate: a `threading.Event` the test sets to release the request.
        then: the behaviour that answers once released.
    """

    gate: threading.Event
    then: Behaviour

    async def respond(self, exchange: Exchange) -> None:
        while not self.gate.is_set():
            await exchange.sleep(0.02)
        await self.then.respond(exchange)
