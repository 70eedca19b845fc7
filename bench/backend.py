"""A fast stand-in for an inference node, for benchmarks: raw asyncio on uvloop, HTTP/1.1 keep-alive.

`POST` with `"stream": true` in the body gets an SSE stream of `--events` chat.completion.chunk events
(chunked transfer encoding, one write per event) and `data: [DONE]`; any other `POST` gets one fixed
chat.completion JSON; `GET /health` gets `{"status":"ok"}`. It does no real work, so what a benchmark
measures is the HTTP path, not inference.

    python bench/backend.py --port 9001 --events 100
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvloop

COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "bench",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()
CHUNK = (
    b'data: {"id":"cmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench",'
    b'"choices":[{"index":0,"delta":{"content":"tok "},"finish_reason":null}]}\n\n'
)
DONE = b"data: [DONE]\n\n"


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class BenchProtocol(asyncio.Protocol):
    def __init__(self, events: int, delay_s: float = 0.0) -> None:
        self.events = events
        self.delay_s = delay_s
        self.buffer = b""
        self.transport: asyncio.WriteTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buffer) < head_end + 4 + length:
                return
            body = self.buffer[head_end + 4 : head_end + 4 + length]
            self.buffer = self.buffer[head_end + 4 + length :]
            self.respond(head.split(" ", 2)[1], body)

    def respond(self, path: str, body: bytes) -> None:
        assert self.transport is not None
        if path == "/health":
            payload = b'{"status":"ok"}'
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(payload), payload)
            )
        elif b'"stream": true' in body or b'"stream":true' in body:
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            if self.delay_s:
                self._paced(self.events)
                return
            for _ in range(self.events):
                self.transport.write(_chunked(CHUNK))
            self.transport.write(_chunked(DONE) + b"0\r\n\r\n")
        else:
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(COMPLETION), COMPLETION)
            )

    def _paced(self, left: int) -> None:
        """One event now and the next `delay_s` later (`--delay-ms`); then `[DONE]`."""
        assert self.transport is not None
        if self.transport.is_closing():
            return
        if left == 0:
            self.transport.write(_chunked(DONE) + b"0\r\n\r\n")
            return
        self.transport.write(_chunked(CHUNK))
        asyncio.get_running_loop().call_later(self.delay_s, self._paced, left - 1)


async def serve(host: str, port: int, events: int, delay_s: float = 0.0) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: BenchProtocol(events, delay_s), host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--events", type=int, default=100, help="events per streamed response")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="time between the events of a stream")
    args = parser.parse_args()
    uvloop.run(serve(args.host, args.port, args.events, args.delay_ms / 1000))


if __name__ == "__main__":
    main()
