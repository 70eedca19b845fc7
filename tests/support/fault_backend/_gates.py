"""Delays and gates: a request held until the client gives up, or until the test releases it; a stream that
lasts until then.

Shorter delays are fields of the other behaviours (`Json.delay_s`, the `Sse` delays); these hold a request for as
long as the test needs, whatever the machine's speed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from tests.support.fault_backend._exchange import Behaviour, Exchange
from tests.support.fault_backend._payloads import chat_chunk, sse_event


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


@dataclass(frozen=True)
class Trickle(Behaviour):
    """A chat stream that lasts until the test sets `gate` (or the client leaves): its first token at once, then
    one every `interval_s`, so neither a first-token nor an idle limit of the gateway ends it; `data: [DONE]` once
    released.

    For a request that must stay in flight for as long as a test needs it, whatever the machine's speed and the
    gateway's limits (a plain `Hang` is ended by the gateway's first-token or answer limit).

    Attributes:
        gate: a `threading.Event` the test sets to end the stream; None: until the client leaves.
        interval_s: seconds between two tokens; far below any idle limit a test daemon sets (1 s at least).
    """

    gate: threading.Event | None = None
    interval_s: float = 0.1

    async def respond(self, exchange: Exchange) -> None:
        await exchange.start_stream(
            200, {"content-type": "text/event-stream", "cache-control": "no-cache"}, chunked=True
        )
        completion_id = f"chatcmpl-trickle-{exchange.port}-{exchange.serial}"
        index = 0
        while self.gate is None or not self.gate.is_set():
            role = "assistant" if index == 0 else None
            await exchange.send(
                sse_event(chat_chunk(completion_id, exchange.model, int(time.time()), content=f"t{index} ", role=role))
            )
            index += 1
            await exchange.sleep(self.interval_s)
        await exchange.send(
            sse_event(chat_chunk(completion_id, exchange.model, int(time.time()), content="", finish_reason="stop"))
        )
        await exchange.send(b"data: [DONE]\n\n")
        await exchange.end_stream()
