"""Stream faults: server-sent event streams cut, split, delayed or oversized exactly where a test needs it."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tests.support.fault_backend._exchange import Behaviour, Exchange
from tests.support.fault_backend._payloads import chat_chunk, lower_names, sse_event


@dataclass(frozen=True)
class Sse(Behaviour):
    """A server-sent event stream (`Content-Type: text/event-stream`), with faults placed exactly.

    The body is a list of writes, each sent (and flushed) on its own: by default `n_events` OpenAI
    `chat.completion.chunk` events with delta contents "tok0 ", "tok1 ", ..., the last with finish_reason
    "stop", then `data: [DONE]` when `done`. `events` replaces the generated events (`done` still appends
    `[DONE]`); `writes` replaces the whole body, so one event or one UTF-8 character can be split across writes.

    Attributes:
        events: the exact bytes of each event, blank line included.
        n_events: how many chunk events to generate when neither `events` nor `writes` is given.
        writes: the exact body writes; overrides `events`, `n_events` and `done`.
        delay_headers_s: seconds to wait before sending the head.
        delay_first_event_s: seconds to wait between the head and the first write.
        delay_between_s: seconds to wait between writes (and before a reset after the last of them).
        reset_after_events: send this many writes, then abort the connection with a TCP RST instead of the
            next write (or instead of the end of the body when there are no more writes).
        stall_after_events: send this many writes, then nothing more until the client leaves (a node that hangs
            in the middle of its answer).
        reset_before_headers: read the request, then reset the connection without answering.
        close_after_headers: send the head, then close the connection cleanly without any body.
        done: append `data: [DONE]` to the events.
        chunked: chunked transfer encoding (each write one chunk); False ends the body by closing the
            connection.
        close_after_end: close the connection right after a chunked body's end, whatever its headers said
            (llama-server does this after each streamed answer while advertising `Keep-Alive: timeout=5`).
        headers: extra response headers.
    """

    events: Sequence[bytes] | None = None
    n_events: int = 5
    writes: Sequence[bytes] | None = None
    delay_headers_s: float = 0.0
    delay_first_event_s: float = 0.0
    delay_between_s: float = 0.0
    reset_after_events: int | None = None
    stall_after_events: int | None = None
    reset_before_headers: bool = False
    close_after_headers: bool = False
    done: bool = True
    chunked: bool = True
    close_after_end: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)

    def body_writes(self, exchange: Exchange) -> list[bytes]:
        """The writes this stream sends for `exchange`, before any reset.

        Returns:
            One item per write.
        """
        if self.writes is not None:
            return list(self.writes)
        if self.events is not None:
            events = list(self.events)
        else:
            completion_id = f"chatcmpl-fault-{exchange.port}-{exchange.serial}"
            created = int(time.time())
            events = [
                sse_event(
                    chat_chunk(
                        completion_id,
                        exchange.model,
                        created,
                        content=f"tok{i} ",
                        role="assistant" if i == 0 else None,
                        finish_reason="stop" if i == self.n_events - 1 else None,
                    )
                )
                for i in range(self.n_events)
            ]
        if self.done:
            events.append(b"data: [DONE]\n\n")
        return events

    async def respond(self, exchange: Exchange) -> None:
        if self.reset_before_headers:
            exchange.reset()
            return
        await exchange.sleep(self.delay_headers_s)
        headers = {"content-type": "text/event-stream", "cache-control": "no-cache"}
        headers.update(lower_names(self.headers))
        await exchange.start_stream(200, headers, chunked=self.chunked)
        if self.close_after_headers:
            await exchange.close()
            return
        sent = 0
        for data in self.body_writes(exchange):
            if sent == self.reset_after_events:
                break
            if sent == self.stall_after_events:
                await exchange.wait_for_client_to_leave()
                return
            await exchange.sleep(self.delay_between_s if sent else self.delay_first_event_s)
            await exchange.send(data)
            sent += 1
        if self.reset_after_events is not None:
            await exchange.sleep(self.delay_between_s if sent else self.delay_first_event_s)
            exchange.reset()
            return
        await exchange.end_stream()
        if self.close_after_end:
            await exchange.close()


def big_line_event(size_bytes: int = 1 << 20, *, model: str = "fault-model") -> bytes:
    """One `data: {...}\\n\\n` event holding a valid chat.completion.chunk, padded to `size_bytes` in total.

    Args:
        size_bytes: the length of the whole event in bytes; an event never gets shorter than its JSON
            envelope (about 200 bytes).
        model: the model named in the chunk.

    Returns:
        The event's bytes, blank line included.
    """
    created = int(time.time())
    empty = sse_event(chat_chunk("chatcmpl-fault-big", model, created, content=""))
    padding = max(0, size_bytes - len(empty))
    return sse_event(chat_chunk("chatcmpl-fault-big", model, created, content="x" * padding))
