"""Server-sent event framing for the relay.

The relay forwards the node's bytes unchanged but only ever hands whole events to the client, so that a
failure in the middle of an event can be followed by a clean in-band error event instead of a corrupt one.
An event ends with a blank line; the line terminators the SSE specification allows give the boundaries
`\\n\\n`, `\\r\\n\\r\\n` and `\\r\\r`.

Two questions about whole events decide what a stream means, following the SSE specification's
interpretation of an event stream (https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation):
only an event with a `data` field is dispatched to the client's code; comments (lines starting with `:`,
the pings `llama-server --sse-ping-interval` sends) and events without data (a blank line, a lone
`event:` or `id:`) never are. So `first_data_event` finds where a stream's answer begins, and
`ends_with_done` whether it ended with OpenAI's `data: [DONE]`, its last data event.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

__all__ = ["DONE", "EventFramer", "ends_with_done", "event_boundary", "first_data_event"]

DONE = b"[DONE]"
"""The data of the event that ends an OpenAI chat or completions stream (`data: [DONE]`)."""

_BOUNDARIES = ((b"\n\n", 2), (b"\r\n\r\n", 4), (b"\r\r", 2))

_LINE = re.compile(rb"([^\r\n]*)(\r\n|\r|\n|$)")
"""One line and its terminator (none for an unfinished last line)."""


def event_boundary(buffer: bytes | bytearray, start: int = 0) -> int:
    """The index just past the last complete event in `buffer`, or 0 when there is none.

    Args:
        buffer: bytes received so far.
        start: where to begin looking (bytes before it are known to hold no boundary end).
    """
    end = 0
    for marker, size in _BOUNDARIES:
        found = buffer.rfind(marker, start)
        if found >= 0 and found + size > end:
            end = found + size
    return end


class EventFramer:
    """Cuts a byte stream into runs of whole events, holding back an unfinished event.

    Args:
        max_event_bytes: an unfinished event longer than this is released as is, so one huge event cannot
            hold unbounded memory.
    """

    __slots__ = ("_pending", "max_event_bytes")

    def __init__(self, max_event_bytes: int) -> None:
        self.max_event_bytes = max_event_bytes
        self._pending = bytearray()

    @property
    def pending(self) -> int:
        """Bytes held back (an unfinished event)."""
        return len(self._pending)

    def feed(self, chunk: bytes) -> bytes:
        """Add a chunk; return the bytes that complete whole events (possibly empty)."""
        if not self._pending:
            # The common case: a chunk that is exactly one or more whole events.
            if chunk.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")):
                return chunk
            end = event_boundary(chunk)
            if end == 0:
                self._pending += chunk
                return self._overflow()
            self._pending += chunk[end:]
            return chunk[:end]
        # A boundary may straddle the old and new bytes: look back three bytes.
        search_from = max(0, len(self._pending) - 3)
        self._pending += chunk
        end = event_boundary(self._pending, search_from)
        if end == 0:
            return self._overflow()
        out = bytes(self._pending[:end])
        del self._pending[:end]
        return out

    def _overflow(self) -> bytes:
        if len(self._pending) > self.max_event_bytes:
            return self.flush()
        return b""

    def flush(self) -> bytes:
        """Release whatever is held back (at the clean end of a stream)."""
        out = bytes(self._pending)
        self._pending.clear()
        return out


def _data_events(events: bytes) -> Iterator[tuple[int, bytes | None]]:
    """Each event of `events`: its offset, and its data (lines joined with `\\n`), or None without a data field.

    An unfinished last event (no blank line after it) counts as an event too.
    """
    start = 0
    data: list[bytes] | None = None
    has_lines = False
    for match in _LINE.finditer(events):
        line, end = match.group(1), match.group(2)
        if not line:
            if not end:
                break  # the end of the bytes
            # A blank line ends the event.
            yield start, b"\n".join(data) if data is not None else None
            data, has_lines, start = None, False, match.end()
            continue
        has_lines = True
        if line == b"data" or line.startswith(b"data:"):
            value = line[5:]
            if data is None:
                data = []
            data.append(value[1:] if value.startswith(b" ") else value)
        if not end:
            break
    if has_lines:
        yield start, b"\n".join(data) if data is not None else None


def first_data_event(events: bytes) -> int:
    """Where the first event with a `data` field begins in `events`, or -1 when none has one.

    Comments (`:` lines, such as llama-server's `:` pings) and events without data come before it, or are
    all there is.

    Args:
        events: whole events.
    """
    if events.startswith(b"data:"):
        # A node that sends no comments: the first event is data.
        return 0
    for start, data in _data_events(events):
        if data is not None:
            return start
    return -1


def ends_with_done(events: bytes) -> bool:
    """Whether the last event with a `data` field in `events` is OpenAI's `data: [DONE]`.

    Events without data after it (comments) do not change the answer; an unfinished event at the end is
    read as if its blank line had come.

    Args:
        events: the last events of a stream.
    """
    if events.endswith(b"data: [DONE]\n\n"):
        return True
    last: bytes | None = None
    for _, data in _data_events(events):
        if data is not None:
            last = data
    return last is not None and last.strip() == DONE
