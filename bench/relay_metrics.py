"""What the relay costs per relayed event, and the metrics per request (`GatewayMetrics.account`).

The relay's loop and the accounting run in-process against stand-ins that cost next to nothing (a node whose
`read()` returns the next event at once, a client whose `send` does nothing), so the figures are the Python
work of the gateway alone, without sockets. The relay is timed twice: its loop alone, and with the node's
answer (`UpstreamResponse.read`: the idle limit, the SSE framing) over a stand-in node response whose
`readany()` hands over the next event at once. The same work is timed for the relay, response and metrics
modules of a baseline revision (`git show REV:qiip_proxy/_relay.py`), loaded next to the current ones, so the
difference is what the current code adds.

    uv run python bench/relay_metrics.py                     # against HEAD
    uv run python bench/relay_metrics.py --baseline 5971fe0  # against an older revision

Figures are the best of `--repeat` runs; they move with the machine, the differences much less.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import json
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvloop

from qiip_core.config import UpstreamSettings
from qiip_core.routing import RoutingTable

ROOT = Path(__file__).resolve().parent.parent

EVENT = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" tok"}}],"created":1,'
    b'"id":"chatcmpl-bench","model":"bench","object":"chat.completion.chunk"}\n\n'
)
"""A llama-server chat chunk (about 170 bytes)."""

USAGE_EVENT = (
    b'data: {"choices":[],"created":1,"id":"chatcmpl-bench","model":"bench","object":"chat.completion.chunk",'
    b'"usage":{"completion_tokens":100,"prompt_tokens":54,"total_tokens":154},"timings":{"cache_n":0}}\n\n'
)
DONE = b"data: [DONE]\n\n"


def load(module: str, revision: str, package: str = "qiip_proxy") -> types.ModuleType:
    """`<package>.<module>` as it was at `revision`, as a module of its own."""
    path = f"{package.replace('.', '/')}/{module}.py"
    source = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, capture_output=True, check=True).stdout
    loaded = types.ModuleType(f"{package}.{module}_at_{revision}")
    loaded.__dict__["__name__"] = loaded.__name__
    sys.modules[loaded.__name__] = loaded
    exec(compile(source, f"{revision}:{path}", "exec"), loaded.__dict__)
    return loaded


class Node:
    """A committed stream whose events are all there: `read()` returns the next one at once."""

    def __init__(self, events: int) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.status_code, self.sse, self.complete, self.node_id = 200, True, False, "bench"
        self.prefix = EVENT
        self._events = iter([EVENT] * (events - 2) + [USAGE_EVENT, DONE])

    async def read(self) -> bytes:
        return next(self._events, b"")


class _Content:
    """A node's body as the response reads it (`readany()`, aiohttp's `StreamReader` and the node client's
    `NodeResponse` alike): the next event after one turn of the event loop, as an event that came in a socket read
    of its own does (the loop also drops the timers cancelled in the meantime, which it would never do if no read
    ever waited)."""

    def __init__(self, events: int) -> None:
        self._events = iter([EVENT] * (events - 2) + [USAGE_EVENT, DONE])
        self._eof = False

    async def readany(self) -> bytes:
        await asyncio.sleep(0)
        chunk = next(self._events, b"")
        self._eof = not chunk
        return chunk

    def at_eof(self) -> bool:
        return self._eof


class _NodeResponse(_Content):
    """A node's `text/event-stream` answer, headers received, as `UpstreamResponse.receive` reads it: the node
    client's `NodeResponse`, and (`content`, `headers`) aiohttp's `ClientResponse` for revisions before it."""

    status = 200
    content_type = "text/event-stream"
    headers: dict[str, str] = {}
    raw_headers = ((b"Content-Type", b"text/event-stream"),)
    whole = False

    def __init__(self, events: int) -> None:
        super().__init__(events)
        self.content = self

    def header(self, name: str) -> str | None:
        return "text/event-stream" if name == "content-type" else None

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Reservation:
    """A node's reservation as the response reports to it (an `OutcomeSink`; `state` for revisions before it)."""

    node_id = "bench"
    health_failures = 0
    state = types.SimpleNamespace(id="bench", health_failures=0)
    released = False

    def record_success(self) -> None:
        pass

    def record_failure(self, reason: str) -> None:
        pass

    def release(self) -> None:
        self.released = True


async def _nothing(message: Any) -> None:
    pass


def outcome() -> types.SimpleNamespace:
    """An outcome either revision's relay can write (it only sets attributes)."""
    return types.SimpleNamespace(started=time.perf_counter(), ttft_s=None, first_token_s=None, error_code=None)


def ns_per_event(relay: Callable[..., Any], events: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        node = Node(events)
        started = time.perf_counter_ns()
        asyncio.run(relay(node, _nothing, "req", outcome()))
        best = min(best, (time.perf_counter_ns() - started) / events)
    return best


def ns_per_event_read(relay: Callable[..., Any], response_type: Any, events: int, repeat: int) -> float:
    """The relay over a committed `UpstreamResponse` (of `response_type`'s revision), per event."""

    async def one() -> None:
        loop = asyncio.get_running_loop()
        upstream = await response_type.receive(
            _Reservation(), _NodeResponse(events), UpstreamSettings(), deadline=loop.time() + 3600
        )
        await relay(upstream, _nothing, "req", outcome())
        await upstream.aclose()

    best = float("inf")
    for _ in range(repeat):
        # On uvloop, as the daemon runs (uvicorn's `loop="auto"`).
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            started = time.perf_counter_ns()
            runner.run(one())
            best = min(best, (time.perf_counter_ns() - started) / events)
    return best


def ns_per_call(call: Callable[[], object], calls: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter_ns()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter_ns() - started) / calls)
    return best


def accounting(metrics_module: types.ModuleType) -> dict[str, Callable[[], object]]:
    """One `account()` per kind of answer, as the revision's `Outcome` describes it."""
    metrics = metrics_module.GatewayMetrics(RoutingTable())
    outcome_type = metrics_module.Outcome
    # Revisions before the token and TTFT metrics (5971fe0 and earlier) kept no answer end.
    current = "answer_end" in {field.name for field in dataclasses.fields(outcome_type)}
    small = json.dumps(
        {"choices": [{"message": {"content": "x" * 500}}], "usage": {"prompt_tokens": 9, "completion_tokens": 100}}
    ).encode()
    embeddings = json.dumps(
        {"data": [{"embedding": [0.123456789] * 50_000}], "usage": {"prompt_tokens": 9, "total_tokens": 9}}
    ).encode()
    no_usage = embeddings.replace(b'"usage"', b'"other"')

    def account(**answer: Any) -> Callable[[], object]:
        if not current:
            # The baseline relayed the same answers but kept neither their end nor the time of a data event.
            del answer["answer_end"]
            if "first_token_s" in answer:
                answer["ttft_s"] = answer.pop("first_token_s")
        return lambda: metrics.account(
            outcome_type(started=0.0, model="m", node="n", status=200, duration_s=1.0, **answer)
        )

    return {
        "stream, usage in its last event": account(answer_end=(USAGE_EVENT, DONE), first_token_s=0.2),
        "stream without usage": account(answer_end=(EVENT, DONE), first_token_s=0.2),
        f"JSON body of {len(small)} B": account(answer_end=(b"", small)),
        f"embeddings body of {len(embeddings) >> 10} KiB": account(answer_end=(b"", embeddings)),
        f"body of {len(no_usage) >> 10} KiB without usage": account(answer_end=(b"", no_usage)),
    }


def _load_response(revision: str) -> types.ModuleType:
    """`UpstreamResponse`'s module at `revision`: in `qiip_core.upstream`, or in `qiip_core.routing` before sending
    moved out of routing."""
    try:
        return load("_response", revision, "qiip_core.upstream")
    except subprocess.CalledProcessError:
        return load("_response", revision, "qiip_core.routing")


def _serve_the_old_layout(revision: str) -> None:
    """Before `qiip_core.upstream`, the modules of `revision` import the sending names and modules from routing:
    in this process only, let those imports find them where they are now."""
    found = subprocess.run(
        ["git", "cat-file", "-e", f"{revision}:qiip_core/upstream"], cwd=ROOT, capture_output=True, check=False
    )
    if found.returncode == 0:
        return
    import qiip_core.routing as routing
    import qiip_core.upstream as upstream

    for name in upstream.__all__:
        if not hasattr(routing, name):
            setattr(routing, name, getattr(upstream, name))
    for old, new in (("_sse", "_sse"), ("_upstream", "_client"), ("_response", "_response")):
        sys.modules.setdefault(f"qiip_core.routing.{old}", importlib.import_module(f"qiip_core.upstream.{new}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="HEAD", help="the revision to compare with (default HEAD)")
    parser.add_argument("--events", type=int, default=200_000, help="events per relayed stream")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    from qiip_core.upstream import UpstreamResponse
    from qiip_proxy import _metrics, _relay

    _serve_the_old_layout(args.baseline)
    old_relay, old_metrics = load("_relay", args.baseline), load("_metrics", args.baseline)
    old_response = _load_response(args.baseline)
    print(f"relay, ns per event (best of {args.repeat} streams of {args.events:,} events):")
    base = ns_per_event(old_relay.relay, args.events, args.repeat)
    now = ns_per_event(_relay.relay, args.events, args.repeat)
    print(f"  loop alone          {args.baseline}: {base:7.1f}   current: {now:7.1f}   added: {now - base:+6.1f}")
    base = ns_per_event_read(old_relay.relay, old_response.UpstreamResponse, args.events, args.repeat)
    now = ns_per_event_read(_relay.relay, UpstreamResponse, args.events, args.repeat)
    print(f"  with the node read  {args.baseline}: {base:7.1f}   current: {now:7.1f}   added: {now - base:+6.1f}")

    print(f"account(), µs per request (best of {args.repeat} runs of 2,000):")
    current, before = accounting(_metrics), accounting(old_metrics)
    for name, call in current.items():
        base_us = ns_per_call(before[name], 2000, args.repeat) / 1000
        now_us = ns_per_call(call, 2000, args.repeat) / 1000
        print(f"  {name:34} {args.baseline}: {base_us:6.2f}   current: {now_us:6.2f}   added: {now_us - base_us:+6.2f}")


if __name__ == "__main__":
    main()
