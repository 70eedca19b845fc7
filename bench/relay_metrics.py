"""What the metrics cost the relay: per relayed event, and per request (`GatewayMetrics.account`).

The relay's loop and the accounting run in-process against stand-ins that cost next to nothing (a node whose
`read()` returns the next event at once, a client whose `send` does nothing), so the figures are the Python
work of the gateway alone, without sockets. The same work is timed for the relay and metrics modules of a
baseline revision (`git show REV:qiip_proxy/_relay.py`), loaded next to the current ones, so the difference
is what the current code adds.

    uv run python bench/relay_metrics.py                     # against HEAD
    uv run python bench/relay_metrics.py --baseline 5971fe0  # against an older revision

Figures are the best of `--repeat` runs; they move with the machine, the differences much less.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def load(module: str, revision: str) -> types.ModuleType:
    """`qiip_proxy.<module>` as it was at `revision`, as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{revision}:qiip_proxy/{module}.py"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    loaded = types.ModuleType(f"qiip_proxy.{module}_at_{revision}")
    loaded.__dict__["__name__"] = loaded.__name__
    sys.modules[loaded.__name__] = loaded
    exec(compile(source, f"{revision}:qiip_proxy/{module}.py", "exec"), loaded.__dict__)
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


def ns_per_call(call: Callable[[], object], calls: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter_ns()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter_ns() - started) / calls)
    return best


def accounting(metrics_module: types.ModuleType, current: bool) -> dict[str, Callable[[], object]]:
    """One `account()` per kind of answer, as the revision's `Outcome` describes it."""
    metrics = metrics_module.GatewayMetrics(RoutingTable())
    outcome_type = metrics_module.Outcome
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="HEAD", help="the revision to compare with (default HEAD)")
    parser.add_argument("--events", type=int, default=200_000, help="events per relayed stream")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    from qiip_proxy import _metrics, _relay

    old_relay, old_metrics = load("_relay", args.baseline), load("_metrics", args.baseline)
    print(f"relay, ns per event (best of {args.repeat} streams of {args.events:,} events):")
    base = ns_per_event(old_relay.relay, args.events, args.repeat)
    now = ns_per_event(_relay.relay, args.events, args.repeat)
    print(f"  {args.baseline}: {base:7.1f}   current: {now:7.1f}   added: {now - base:+6.1f}")

    print(f"account(), µs per request (best of {args.repeat} runs of 2,000):")
    current, before = accounting(_metrics, True), accounting(old_metrics, False)
    for name, call in current.items():
        base_us = ns_per_call(before[name], 2000, args.repeat) / 1000
        now_us = ns_per_call(call, 2000, args.repeat) / 1000
        print(f"  {name:34} {args.baseline}: {base_us:6.2f}   current: {now_us:6.2f}   added: {now_us - base_us:+6.2f}")


if __name__ == "__main__":
    main()
