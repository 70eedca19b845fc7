"""The node's answer, from its first bytes to its end: what the relay reads, and what the node is credited
with.

`UpstreamResponse.receive()` turns the node's status and headers into a response the gateway can commit to,
once what the client will see first has arrived:

- a 5xx answer is not committed: it raises `UpstreamStatusError`, for the forwarder to fail over; nor is
  a 3xx redirect (`UpstreamTransportError`): never relayed, never followed;
- a non-streaming answer: the status, headers and the body (read whole when it fits
  `buffer_response_bytes`, so a node dying while sending it can still be failed over). A 200 body whose
  end HTTP cannot vouch for (chunked, or ended by the connection's close) must also be whole JSON: a cut
  there looks like an end, and is failed over like a broken connection;
- a streaming answer (`text/event-stream`): the status, headers and the first event with data (the first
  token), so a node that accepts the request and then fails before its first token is failed over too.
  Comments and empty events before it (llama-server's `--sse-ping-interval` pings, `: PROCESSING`) commit
  nothing and are dropped: they carry no output, and the client has not been answered yet.

`read()` then gives the rest of the body, whole SSE events at a time for streams (decoded when the node
compressed them; comments included), under the inter-chunk idle timeout and the node's request deadline.
An OpenAI stream ends with `data: [DONE]`: one that ends without it, however the transport ended it (a
clean close, a chunked body's last chunk, a reset), was cut short, and `read()` raises.

The response holds the node's reservation until `aclose()`, and it is what reports the node's behaviour to
the routing table once committed, so the relay never has to:

- a read that fails (a stream cut before `[DONE]` included) counts one failure against the node's circuit
  breaker, at once; except a timeout when one of the same request's timeouts already counted and the node
  still passes its health probes (`timeout_counted`);
- an answer below 400 read to its end counts as the node's success (its breaker closes) when it is closed;
- an answer abandoned before its end (the client left, the stream was ended) counts neither way; nor does a
  4xx answer, which is the client's.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from qiip_core._errors import UpstreamError, UpstreamStatusError, UpstreamTimeout, UpstreamTransportError
from qiip_core.config import UpstreamSettings
from qiip_core.nodes import is_load_failure
from qiip_core.upstream._answer import (
    DECODABLE,
    ERROR_BODY_BYTES,
    buffer,
    node_error_reason,
    read_at_most,
    relay_headers,
    whole_json,
)
from qiip_core.upstream._client import TRANSPORT_ERRORS, map_transport_error
from qiip_core.upstream._http11 import NodeResponse
from qiip_core.upstream._sse import EventFramer, ends_with_done, first_data_event

__all__ = ["ABORT_GRACE_S", "OutcomeSink", "UpstreamResponse"]

ABORT_GRACE_S = 1.0
"""How long an answer whose node failed its health probes may still wait for its next bytes (`abort`)."""


class OutcomeSink(Protocol):
    """Where a response reports how its node behaved, and gives the node back at its end.

    The routing table's `Reservation` implements it; the response needs nothing else of routing, so sending
    never depends on deciding.
    """

    @property
    def node_id(self) -> str:
        """The node the request was sent to."""

    @property
    def health_failures(self) -> int:
        """The node's consecutive failed health probes (0 while it passes them)."""

    @property
    def released(self) -> bool:
        """True once `release()` was called."""

    def record_success(self) -> None:
        """The request succeeded on the node: its breaker closes."""

    def record_failure(self, error: str, *, noted: bool = False) -> bool:
        """The request failed on the node (counted against its breaker); True when the breaker is open."""

    def note_error(self, error: str, *, status: int | None = None) -> None:
        """Keep a failure in the node's error record without counting it against the node's breaker."""

    def release(self) -> None:
        """Give the node's slot back. Idempotent."""


@dataclass(slots=True, eq=False)
class UpstreamResponse:
    """A node's response that the gateway has committed to relaying.

    Attributes:
        reservation: where the node's outcome is reported (the routing table's reservation), released by
            `aclose()`.
        status_code: the node's status.
        headers: response headers to relay: hop-by-hop, CORS and the gateway's own (server, date, request id)
            removed; for SSE also content-encoding and cache-control.
        prefix: the bytes already read: a stream's first events, from its first data event on, or the start
            (or all) of a body.
        complete: True when `prefix` is the whole body, or once a stream has been read to its `[DONE]`.
        sse: True for an event stream (relayed whole events at a time).
        attempts: nodes tried, this one included.
        failures: the errors of the earlier attempts, oldest first.
        timeout_counted: one of this request's timeouts already counted against a node's breaker; a timeout
            of this node then counts only if the node fails its health probes.
    """

    reservation: OutcomeSink
    status_code: int
    headers: list[tuple[bytes, bytes]]
    prefix: bytes
    complete: bool
    sse: bool
    attempts: int = 1
    failures: list[UpstreamError] = field(default_factory=list)
    timeout_counted: bool = False
    _response: NodeResponse | None = None
    _framer: EventFramer | None = None
    _decoder: zlib._Decompress | None = None
    # None before the commit: the forwarder's first-byte limit bounds those reads.
    _idle_timeout_s: float | None = None
    _deadline: float | None = None
    _committed: bool = False
    # The last events read that were not only comments: where a stream's `[DONE]` is looked for at its end.
    _last: bytes = b""
    # The idle limit: one timer per stream, not one per read (`_on_idle_timer`). Each read stamps when it gives
    # up (`_due`, on the loop's clock) and which task waits (`_reader`, None between reads).
    _loop: asyncio.AbstractEventLoop | None = None
    _due: float = 0.0
    _reader: asyncio.Task[object] | None = None
    _idle_timer: asyncio.TimerHandle | None = None
    # The timer cancelled the waiting read; `_cancelling` is the task's count of cancel requests before it.
    _expiring: bool = False
    _cancelling: int = 0
    _abort_reason: str | None = None
    # The set of the node's committed responses this one is in (`Forwarder`), left on `aclose()`.
    _registry: set[UpstreamResponse] | None = None

    @classmethod
    async def receive(
        cls,
        reservation: OutcomeSink,
        response: NodeResponse,
        settings: UpstreamSettings,
        *,
        deadline: float | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> UpstreamResponse:
        """Read what the client will see first, and commit to the node's answer.

        Args:
            reservation: the node's reservation, handed to the response.
            response: the node's answer, headers received.
            settings: the idle timeout, buffer and event sizes.
            deadline: the event-loop time by which the node must have finished (its `deadline_s`), or None.
                It bounds the reads after this one; this one is bounded by the caller's first-byte timeout.
            loop: the running event loop (found when not given).

        Returns:
            The committed response; the caller must `aclose()` it.

        Raises:
            UpstreamStatusError: the node answered 5xx (at most 4 KiB of its body kept).
            UpstreamTransportError: the node answered with a redirect; a stream broke, or ended, before its
                first data event; a 200 body without a declared length is not whole JSON.
            NodeHttpError, zlib.error, TimeoutError, OSError: reading a non-streaming body failed (the
                forwarder translates these with `map_transport_error`).
        """
        node_id = reservation.node_id
        status = response.status
        if status >= 500:
            body = await read_at_most(response, ERROR_BODY_BYTES)
            text = body[:200].decode("utf-8", "replace")
            # The client reads the gateway's own words, which never quote a node; a failure to load the model is
            # named in them (the node's text is the detail, for the log and the admin API).
            reason = node_error_reason(body)
            loading = " It lists the model but could not load it into memory." if is_load_failure(reason) else ""
            raise UpstreamStatusError(
                f"the node answered HTTP {status}.{loading}",
                node_id=node_id,
                status=status,
                body=body,
                detail=reason or text or None,
            )
        if 300 <= status < 400:
            # Relayed, a redirect would send the client's prompt to an address no allowlist checked (the
            # openai client follows 307 and 308 with the body); followed, the gateway would. Neither: the node
            # misbehaves, and another one may be tried.
            raise UpstreamTransportError(
                f"the node answered with a redirect (HTTP {status}), which is never relayed or followed.",
                node_id=node_id,
            )
        encoding = (response.header("content-encoding") or "identity").lower()
        sse = status == 200 and response.content_type == "text/event-stream" and encoding in DECODABLE
        result = cls(
            reservation=reservation,
            status_code=status,
            headers=relay_headers(response, decoded=sse),
            prefix=b"",
            complete=False,
            sse=sse,
            _response=response,
        )
        if sse:
            result._framer = EventFramer(settings.max_event_bytes)
            if encoding != "identity":
                result._decoder = zlib.decompressobj(DECODABLE[encoding])
            result.prefix = await result._first_data_events()
        else:
            result.prefix, result.complete = await buffer(response, settings.buffer_response_bytes)
            if (
                result.complete
                and status == 200
                and response.header("content-length") is None
                and not whole_json(result.prefix, encoding)
            ):
                raise UpstreamTransportError(
                    f"the node's answer is not whole JSON: its body ended after {len(result.prefix)} bytes, "
                    "without a declared length, so it was cut short.",
                    node_id=node_id,
                )
        if result.complete:
            response.release()
            result._response = None
        result._idle_timeout_s = settings.idle_timeout_s
        result._deadline = deadline
        result._loop = loop or asyncio.get_running_loop()
        # From here on, the response reports the node's failures itself; before, the forwarder does (and
        # fails over).
        result._committed = True
        return result

    @property
    def node_id(self) -> str:
        """The node serving this response."""
        return self.reservation.node_id

    async def _first_data_events(self) -> bytes:
        """Read a stream up to its first event with data; what comes before it is dropped."""
        while True:
            events = await self.read()
            start = first_data_event(events)
            if start >= 0:
                return events[start:] if start else events

    async def read(self) -> bytes:
        """The next piece of the body: whole events for a stream. Returns b"" at the end.

        Raises:
            UpstreamTimeout: the node sent nothing for `idle_timeout_s`, or its request deadline passed.
            UpstreamTransportError: the connection broke, or a stream ended without `data: [DONE]` (the relay
                reports it in-band).
        """
        response = self._response
        if self.complete or response is None:
            return b""
        loop = self._loop
        try:
            while True:
                if loop is not None:
                    # Committed: this read gives up at `due` (the idle limit, or the deadline when nearer), which
                    # the stream's one idle timer enforces; the timer is armed only when none is.
                    now = loop.time()
                    due = now + self._idle_timeout_s  # type: ignore[operator] # set with `_loop`
                    deadline = self._deadline
                    if deadline is not None and due > deadline:
                        if now >= deadline:
                            raise UpstreamTimeout(
                                "the request's deadline passed.", node_id=self.node_id, request_sent=True
                            )
                        due = deadline
                    self._due = due
                    if self._idle_timer is None:
                        self._idle_timer = loop.call_at(due, self._on_idle_timer)
                    self._reader = asyncio.current_task(loop)
                try:
                    # Before the commit, the forwarder's first-byte limit bounds the read.
                    chunk = await response.readany()
                    self._reader = None
                    if self._decoder is not None:
                        chunk = self._decoder.decompress(chunk) if chunk else self._decoder.flush()
                except asyncio.CancelledError:
                    self._reader = None
                    if not self._expiring:
                        raise
                    self._expiring = False
                    task = asyncio.current_task()
                    if task is None or task.uncancel() > self._cancelling:
                        # Cancelled from outside too (the client left): that cancellation wins.
                        raise
                    raise self._idle_error() from None
                except TRANSPORT_ERRORS as exc:
                    self._reader = None
                    raise map_transport_error(exc, self.node_id) from exc
                except BaseException:
                    # Whatever else ends the read: the timer must never cancel this task outside it.
                    self._reader = None
                    raise
                if not chunk and response.at_eof():
                    if self._framer is None:
                        self.complete = True
                        return b""
                    return self._end_of_stream()
                if self._framer is None:
                    if chunk:
                        return chunk
                    continue
                out = self._framer.feed(chunk)
                if out:
                    if not out.startswith(b":") or b"data" in out:
                        # Not keep-alive comments only: these events may hold the stream's last data event.
                        self._last = out
                    return out
        except UpstreamError as exc:
            # The node broke off its answer: its fault, whatever the request. (This try is free in the relay's
            # hot loop: since Python 3.11 a try costs nothing until it catches.)
            self._charge(exc)
            raise

    def _charge(self, exc: UpstreamError) -> None:
        """The node broke off its committed answer: in its record, and counted against its breaker (a timeout at
        most once per request while the node passes its health probes: a request too big for the limits times out
        wherever it goes)."""
        if self._committed:
            # In the node's record whether or not it counts (before commit the forwarder keeps it).
            self.reservation.note_error(exc.log_text)
            if not (
                self.timeout_counted and isinstance(exc, UpstreamTimeout) and self.reservation.health_failures == 0
            ):
                self.reservation.record_failure(exc.log_text, noted=True)

    @property
    def pumpable(self) -> bool:
        """Whether `pump` can relay the rest: a committed event stream that the node sends uncompressed."""
        return self.sse and self._committed and self._decoder is None and not self.complete

    async def pump(self, write: Callable[[bytes], bool], pieces: list[bytes]) -> bool:
        """Relay the rest of a committed event stream straight from the node's connection: whole events go to
        `write` as the node's bytes are parsed, without this task waking for each read (the relay's hot path for
        streams, docs/performance.md). The idle limit and the deadline hold as for `read`, counted from the last
        bytes the node sent; the time the client takes to read is not counted.

        Args:
            write: writes events to the client; returns False when the client cannot take more for now (the pump
                then stops reading the node and returns False: wait for the client, then call it again).
            pieces: the last two pieces written, `[before, last]`, kept up to date (the node's `usage` is in them).

        Returns:
            True once the stream has ended with `[DONE]` (every event written), False to wait for the client.

        Raises:
            UpstreamTimeout, UpstreamTransportError: as `read` (the events before were written).
        """
        response = self._response
        loop = self._loop
        framer = self._framer
        if self.complete or response is None or loop is None or framer is None:
            return True
        idle_s: float = self._idle_timeout_s  # type: ignore[assignment] # set with `_loop`
        deadline = self._deadline

        def sink(chunk: bytes) -> None:
            # Each piece moves the limit: the node is not silent.
            due = loop.time() + idle_s
            self._due = deadline if deadline is not None and due > deadline else due
            out = framer.feed(chunk)
            if out:
                if not out.startswith(b":") or b"data" in out:
                    self._last = out
                pieces[0], pieces[1] = pieces[1], out
                if not write(out):
                    response.hold()

        try:
            now = loop.time()
            if deadline is not None and now >= deadline:
                raise UpstreamTimeout("the request's deadline passed.", node_id=self.node_id, request_sent=True)
            due = now + idle_s
            self._due = deadline if deadline is not None and due > deadline else due
            if self._idle_timer is None:
                self._idle_timer = loop.call_at(self._due, self._on_idle_timer)
            self._reader = asyncio.current_task(loop)
            try:
                response.stream_to(sink)
                ended = await response.pumped()
            except asyncio.CancelledError:
                if not self._expiring:
                    raise
                self._expiring = False
                task = asyncio.current_task(loop)
                if task is None or task.uncancel() > self._cancelling:
                    raise
                raise self._idle_error() from None
            except TRANSPORT_ERRORS as exc:
                raise map_transport_error(exc, self.node_id) from exc
            finally:
                self._reader = None
                response.unsink()
            if not ended:
                return False
            rest = self._end_of_stream()
            if rest:
                pieces[0], pieces[1] = pieces[1], rest
                write(rest)
            return True
        except UpstreamError as exc:
            self._charge(exc)
            raise

    def _end_of_stream(self) -> bytes:
        """The node ended its event stream: the last unfinished event if it is `[DONE]`, else an error.

        Raises:
            UpstreamTransportError: the stream ended before its first data event, or without `data: [DONE]`.
        """
        assert self._framer is not None
        rest = self._framer.flush()
        if not self._committed:
            raise UpstreamTransportError("the event stream ended before its first data event.", node_id=self.node_id)
        if rest:
            if ends_with_done(rest):
                # `data: [DONE]` without its blank line: complete the event, so every client dispatches it.
                self.complete = True
                return rest.rstrip(b"\r\n") + b"\n\n"
            raise UpstreamTransportError(
                "the node's event stream broke off in the middle of an event, before `data: [DONE]`: the answer "
                "is incomplete.",
                node_id=self.node_id,
            )
        if not ends_with_done(self._last):
            raise UpstreamTransportError(
                "the node ended its event stream without `data: [DONE]`: the answer is incomplete.",
                node_id=self.node_id,
            )
        self.complete = True
        return b""

    def abort(self, reason: str, *, grace_s: float = ABORT_GRACE_S) -> None:
        """End the answer from outside, unless it is still flowing: its node failed its health probes. A read
        waiting on the node then gives up `grace_s` from now and raises `UpstreamTransportError` with
        `reason`, which the relay reports in-band; an answer whose bytes keep coming (a node too busy to
        answer its probes in time, not hung) goes on.

        Args:
            reason: what happened, for the client and the logs.
            grace_s: how long the waiting read may still wait, in seconds.
        """
        if self.complete:
            return
        self._abort_reason = reason
        loop = self._loop
        if loop is None or self._reader is None:
            # Between two reads: the answer is flowing, and the next read waits its whole idle limit.
            return
        self._due = loop.time() + grace_s
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = loop.call_at(self._due, self._on_idle_timer)

    def _on_idle_timer(self) -> None:
        """The stream's idle timer: cancel the read waiting past its `_due`, or wait on until then.

        Between reads it stops; the next read arms it again. So a stream costs one timer per idle limit, not
        one per read, and each read only stamps its `_due`.
        """
        self._idle_timer = None
        task = self._reader
        loop = self._loop
        if task is None or loop is None:
            return
        if loop.time() < self._due:
            self._idle_timer = loop.call_at(self._due, self._on_idle_timer)
            return
        # As `asyncio.timeout` does: cancel the task, and turn that cancellation (only) into the timeout.
        self._expiring = True
        self._cancelling = task.cancelling()
        task.cancel()

    def _idle_error(self) -> UpstreamError:
        """The error of a read the idle timer ended: the abort's reason, the deadline, or the idle limit."""
        if self._abort_reason is not None:
            return UpstreamTransportError(self._abort_reason, node_id=self.node_id)
        if self._deadline is not None and self._loop is not None and self._loop.time() >= self._deadline:
            return UpstreamTimeout("the request's deadline passed.", node_id=self.node_id, request_sent=True)
        return UpstreamTimeout(
            f"the node sent nothing for {self._idle_timeout_s:g} s.", node_id=self.node_id, request_sent=True
        )

    async def aclose(self) -> None:
        """Finish with the node's response and release the reservation. Idempotent.

        A response read to its end returns its connection to the pool, and an answer below 400 then counts
        as the node's success; one abandoned early (the client left, the relay failed) closes the connection,
        so the node sees the disconnect at once.
        """
        if self._registry is not None:
            self._registry.discard(self)
            self._registry = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        try:
            response, self._response = self._response, None
            if response is not None:
                if self.complete:
                    response.release()
                else:
                    response.close()
        finally:
            reservation = self.reservation
            if not reservation.released:
                if self.complete and self.status_code < 400 and self._committed:
                    reservation.record_success()
                reservation.release()
