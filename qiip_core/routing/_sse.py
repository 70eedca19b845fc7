"""Server-sent event framing for the relay.

The relay forwards the node's bytes unchanged but only ever hands whole events to the client, so that a
failure in the middle of an event can be followed by a clean in-band error event instead of a corrupt one.
An event ends with a blank line; the line terminators the SSE specification allows give the boundaries
`\\n\\n`, `\\r\\n\\r\\n` and `\\r\\r`.
"""

from __future__ import annotations

__all__ = ["EventFramer", "event_boundary"]

_BOUNDARIES = ((b"\n\n", 2), (b"\r\n\r\n", 4), (b"\r\r", 2))


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
