from __future__ import annotations

from hypothesis import given, strategies as st

from qiip_core.upstream import EventFramer, event_boundary
from qiip_core.upstream._sse import ends_with_done, first_data_event


def test_boundaries() -> None:
    assert event_boundary(b"data: a\n\ndata: b") == 9
    assert event_boundary(b"data: a\r\n\r\n") == 11
    assert event_boundary(b"data: a\r\r") == 9
    assert event_boundary(b"data: a\n") == 0


def test_whole_chunks_pass_through_untouched() -> None:
    framer = EventFramer(1024)
    chunk = b"data: 1\n\ndata: 2\n\n"
    assert framer.feed(chunk) is chunk


def test_split_event_is_held_until_complete() -> None:
    framer = EventFramer(1024)
    assert framer.feed(b"data: hel") == b""
    assert framer.feed(b"lo\n") == b""
    assert framer.feed(b"\ndata: next") == b"data: hello\n\n"
    assert framer.pending == len(b"data: next")
    assert framer.flush() == b"data: next"


def test_boundary_split_across_chunks() -> None:
    framer = EventFramer(1024)
    assert framer.feed(b"data: x\r\n\r") == b""
    assert framer.feed(b"\n") == b"data: x\r\n\r\n"


def test_oversized_event_is_released() -> None:
    framer = EventFramer(8)
    assert framer.feed(b"data: 0123456789") == b"data: 0123456789"
    assert framer.pending == 0


@given(st.lists(st.binary(max_size=40), max_size=20), st.lists(st.integers(1, 30), min_size=1, max_size=50))
def test_framing_never_changes_bytes(events: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(e.replace(b"\n", b" ").replace(b"\r", b" ") + b"\n\n" for e in events)
    framer = EventFramer(1 << 20)
    out = bytearray()
    position = 0
    for size in cuts * 20:
        if position >= len(stream):
            break
        piece = framer.feed(stream[position : position + size])
        if piece:
            assert event_boundary(piece) == len(piece)
        out += piece
        position += size
    out += framer.feed(stream[position:]) if position < len(stream) else b""
    out += framer.flush()
    assert bytes(out) == stream


def test_the_first_data_event_follows_comments_and_empty_events() -> None:
    assert first_data_event(b"data: a\n\n") == 0
    assert first_data_event(b":\n\n: PROCESSING\r\n\r\ndata: a\n\n") == len(b":\n\n: PROCESSING\r\n\r\n")
    assert first_data_event(b"event: ping\n\nid: 3\n\ndata\n\n") == len(b"event: ping\n\nid: 3\n\n")
    assert first_data_event(b":\n\n: PROCESSING\n\n") == -1
    assert first_data_event(b"") == -1
    # A field named like data is not data (SSE: the field name is all before the colon).
    assert first_data_event(b"datum: x\n\n") == -1


def test_done_is_the_last_data_event() -> None:
    assert ends_with_done(b"data: [DONE]\n\n")
    assert ends_with_done(b"data: {}\n\ndata: [DONE]\n\n:\n\n")
    assert ends_with_done(b"data: [DONE]")  # an unfinished last event counts
    assert ends_with_done(b"data:[DONE]\r\n\r\n")
    assert not ends_with_done(b"data: {}\n\n")
    assert not ends_with_done(b"data: [DONE]\n\ndata: {}\n\n")
    assert not ends_with_done(b":\n\n")
    assert not ends_with_done(b"")
