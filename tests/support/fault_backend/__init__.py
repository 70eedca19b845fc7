"""A scripted, fault-injecting stand-in for an inference node, speaking real HTTP/1.1 on loopback.

The gateway's failure handling is about bytes and timing: a node that resets the connection after the third
event, splits a UTF-8 character across two writes, answers 503 while it loads its model, or holds a request
open until the client gives up. A web framework would buffer, reframe or smooth over exactly what these tests
need to control, so this server sits on plain asyncio streams: every body write is one `transport.write`
(one HTTP chunk when the response is chunked), a clean close is a FIN and a reset is a real TCP RST.

The server runs on its own event loop in a daemon thread, so synchronous and asynchronous tests drive it the
same way, and every public method is thread-safe:

    with FaultBackend(model="m") as backend:
        backend.push(Sse(reset_after_events=2))       # the next inference request gets this
        backend.health = LoadingThenOk(loading_s=1)   # /health answers 503 for one second
        ...                                           # point the gateway at backend.url
        backend.wait_for_disconnect()                 # the gateway hung up on the node

Routing: `GET /health` answers `backend.health`; `GET /v1/models` lists the model; `POST` to
`/v1/chat/completions`, `/v1/completions` or `/v1/embeddings` answers the head of the queue filled by
`push()`, else `backend.default` (`Completion()`). Anything else is a 404. Every request is recorded.

Behaviours are frozen dataclasses whose `respond()` drives an `Exchange`; a test can add its own by
subclassing `Behaviour`. The modules, by fault family:

- `_exchange`: `RequestRecord`, `Exchange` and `Behaviour`; the connection faults (`reset()`, `close()`).
- `_status`: status faults: `Json`, `UnframedJson`, `Status`, `LoadingThenOk`.
- `_stream`: stream faults: `Sse`, `big_line_event`.
- `_gates`: delays and gates: `Hang`, `Gated`, `Trickle`.
- `_answers`: valid answers: `Completion` (the default), `Embeddings`.
- `_backend`: `FaultBackend`, the control surface a test holds.
- `_http`: the server plumbing: one connection, its reader task and the request parser.
- `_payloads`: the JSON and OpenAI payloads they all write.
"""

from __future__ import annotations

from tests.support.fault_backend._answers import Completion, Embeddings
from tests.support.fault_backend._backend import FaultBackend
from tests.support.fault_backend._exchange import Behaviour, ClientGone, Exchange, RequestRecord
from tests.support.fault_backend._gates import Gated, Hang, Trickle
from tests.support.fault_backend._status import Json, LoadingThenOk, Status, UnframedJson
from tests.support.fault_backend._stream import Sse, big_line_event

__all__ = [
    "Behaviour",
    "ClientGone",
    "Completion",
    "Embeddings",
    "Exchange",
    "FaultBackend",
    "Gated",
    "Hang",
    "Json",
    "LoadingThenOk",
    "RequestRecord",
    "Sse",
    "Status",
    "Trickle",
    "UnframedJson",
    "big_line_event",
]
