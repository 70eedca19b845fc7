"""Prefix-aware routing against least-connections, on real llama-server nodes, in one run.

A multi-turn workload: `--conversations` chats run at once, each `--turns` turns long; every turn resends
the whole history (a system prompt of about `--prefix-tokens` tokens, then the turns before) and streams a
short answer (`--max-tokens`), the next turn following after a think time (`--think-s` on average, the same
for every phase). The same workload runs in three phases, each on freshly started nodes (empty
caches) of one generated GGUF, big enough that prompt processing dominates the time to first token:

1. `direct`: one node, no gateway, every request sent to it (the baseline: all of a conversation's turns
   find its prefix in the node's prompt cache, but one node does all the work);
2. `least_connections`: two nodes behind the daemon, `routing.policy = "least_connections"`;
3. `prefix_affinity`: two nodes behind the daemon, `routing.policy = "prefix_affinity"`.

Printed per phase: TTFT p50 (client side, to the first data event) of first turns and of later turns, how
many later turns found at least half of their prompt cached, the prompt tokens the nodes reported as cached
(`usage.prompt_tokens_details.cached_tokens`, else `timings.cache_n`) against all prompt tokens, and each
node's share of the requests with the imbalance (the busiest node's requests over the mean, minus one).
Then the ratios of the later turns' TTFT p50.

Before that, the added CPU per request: hashing a request's prefix from the body the parse step already
decoded (`PrefixAffinity.prefix_of`) and choosing and recording its node (`RoutingTable.reserve` with a
prefix), against `RoutingTable.reserve` by least-connections, and against `json.loads` of the same body
(which the gateway does anyway), in µs per request.

    uv run python bench/prefix_routing.py
    uv run python bench/prefix_routing.py --micro-only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qiip_core.config import load_settings  # noqa: E402
from qiip_core.engines.llamacpp import LlamaCppInstaller, make_test_gguf  # noqa: E402
from qiip_core.nodes import Node, NodeStatus  # noqa: E402
from qiip_core.routing import PrefixAffinity, RoutingTable  # noqa: E402
from tests.support.daemon import llama_daemon_with  # noqa: E402

MODEL = "bench-chat"
WORDS = ("river", "stone", "cloud", "amber", "field", "north", "glass", "ember", "maple", "quartz", "delta", "orbit")


@dataclass
class Turn:
    """One request as the client saw it."""

    conversation: int
    turn: int
    ttft_s: float
    node: str
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Phase:
    """One phase's requests."""

    name: str
    turns: list[Turn] = field(default_factory=list)

    def ttft_p50_ms(self, later: bool) -> float:
        return 1000 * statistics.median(t.ttft_s for t in self.turns if (t.turn > 1) is later)

    def report(self) -> None:
        prompt = sum(t.prompt_tokens for t in self.turns)
        cached = sum(t.cached_tokens for t in self.turns)
        shares = Counter(t.node for t in self.turns)
        mean = len(self.turns) / len(shares)
        imbalance = max(shares.values()) / mean - 1
        share_text = ", ".join(f"{node} {count}" for node, count in sorted(shares.items()))
        later = [t for t in self.turns if t.turn > 1]
        warm = sum(1 for t in later if t.cached_tokens >= t.prompt_tokens / 2)
        print(
            f"  {self.name:18} TTFT p50 turn 1: {self.ttft_p50_ms(False):6.0f} ms   turns >= 2: "
            f"{self.ttft_p50_ms(True):6.0f} ms, {warm}/{len(later)} found most of their prompt cached   "
            f"cached prompt tokens: {cached} of {prompt} ({cached / prompt:.0%})   requests per node: "
            f"{share_text} (imbalance {imbalance:.0%})"
        )


def system_prompt(conversation: int, tokens: int) -> str:
    rng = random.Random(conversation)
    # The generated vocabulary is mostly byte tokens: about one token per character.
    words = []
    length = 0
    while length < tokens:
        word = rng.choice(WORDS) + str(rng.randrange(100))
        words.append(word)
        length += len(word) + 1
    return f"Conversation {conversation}. Background: " + " ".join(words)


async def conversation(client: httpx.AsyncClient, url: str, index: int, args: argparse.Namespace, phase: Phase) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt(index, args.prefix_tokens)}]
    think = random.Random(f"think-{index}")
    # Staggered starts, as independent users would arrive.
    await asyncio.sleep(index * args.stagger_s)
    for turn in range(1, args.turns + 1):
        if turn > 1:
            # The user reads the answer and types the next question.
            await asyncio.sleep(think.uniform(0.5, 1.5) * args.think_s)
        messages.append({"role": "user", "content": f"Question {turn} of conversation {index}: what next?"})
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        ttft_s = None
        content: list[str] = []
        usage: dict[str, Any] = {}
        timings: dict[str, Any] = {}
        async with client.stream("POST", url, json=body) as response:
            response.raise_for_status()
            node = response.headers.get("x-qiip-node", "direct")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if ttft_s is None:
                    ttft_s = time.perf_counter() - started
                event = json.loads(line[6:])
                for choice in event.get("choices") or ():
                    content.append(choice.get("delta", {}).get("content") or "")
                usage = event.get("usage") or usage
                timings = event.get("timings") or timings
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", timings.get("cache_n", 0))
        assert ttft_s is not None
        phase.turns.append(Turn(index, turn, ttft_s, node, usage.get("prompt_tokens", 0), cached))
        messages.append({"role": "assistant", "content": "".join(content)})


async def workload(base_url: str, path: str, args: argparse.Namespace, phase: Phase) -> None:
    # A new connection per request: llama-server closes idle keep-alive connections after 5 s, and a pooled
    # one it closed would fail its next request (a fraction of a millisecond, on every phase alike).
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=600, limits=limits) as client:
        await asyncio.gather(*(conversation(client, path, i, args, phase) for i in range(args.conversations)))


def run_phase(name: str, work: Path, server: Path, gguf: Path, args: argparse.Namespace) -> Phase:
    nodes = 1 if name == "direct" else args.nodes
    local = [
        {"id": f"node-{i + 1}", "gguf": str(gguf), "model": MODEL, "slots": args.slots, "threads": 1}
        for i in range(nodes)
    ]
    env = {"QIIP_LOGGING__LEVEL": "WARNING", "QIIP_UPSTREAM__TTFB_TIMEOUT_S": "600"}
    if name != "direct":
        env["QIIP_ROUTING__POLICY"] = name
    phase = Phase(name)
    with llama_daemon_with(work / name, server, local, env=env) as daemon:
        if name == "direct":
            endpoint = daemon.admin.get("/admin/nodes/node-1").json()["endpoint"]
            asyncio.run(workload(endpoint, "/v1/chat/completions", args, phase))
        else:
            asyncio.run(workload(daemon.url, "/v1/chat/completions", args, phase))
            if name == "prefix_affinity":
                routed = {r: daemon.counter("qiip_prefix_affinity_total", result=r) for r in ("hit", "miss")}
                routed["overloaded"] = daemon.counter("qiip_prefix_affinity_total", result="overloaded")
                phase.name = name
                print(f"  ({name}: /metrics qiip_prefix_affinity_total {routed})")
    return phase


def _table(affinity: PrefixAffinity | None) -> RoutingTable:
    table = RoutingTable(affinity=affinity)
    for i in range(4):
        table.apply_put(Node(id=f"n{i}", endpoint=f"http://127.0.0.1:{9000 + i}", model=MODEL), source="config")
        table.set_liveness(f"n{i}", NodeStatus.HEALTHY)
    return table


def _best_us(call: Callable[[], object], repeat: int, calls: int = 1000) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter_ns()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter_ns() - started) / calls / 1000)
    return best


def _best_hash_us(raw: bytes, api: str, affinity: PrefixAffinity, repeat: int, calls: int = 300) -> float:
    """`prefix_of` on bodies parsed afresh, as in the gateway: their strings' hashes are not cached yet."""
    best = float("inf")
    for _ in range(repeat):
        parsed = [json.loads(raw) for _ in range(calls)]
        started = time.perf_counter_ns()
        for payload in parsed:
            affinity.prefix_of(MODEL, api, payload)
        best = min(best, (time.perf_counter_ns() - started) / calls / 1000)
    return best


def micro_one(name: str, payload: dict[str, Any], repeat: int) -> None:
    """One body: the parse (done anyway), least-connections, and what prefix affinity adds to it."""
    raw = json.dumps(payload).encode()
    api = "chat" if "messages" in payload else "completions"
    affinity = PrefixAffinity(max_entries=50_000)
    plain, sticky = _table(None), _table(affinity)
    prefix = affinity.prefix_of(MODEL, api, payload)

    parse_us = _best_us(lambda: json.loads(raw), repeat)
    base_us = _best_us(lambda: plain.reserve(MODEL).release(), repeat)
    hash_us = _best_hash_us(raw, api, affinity, repeat)
    sticky_us = _best_us(lambda: sticky.reserve(MODEL, prefix=prefix).release(), repeat)
    added = hash_us + sticky_us - base_us
    print(
        f"  {name:28} json.loads {parse_us:6.1f}   reserve: least-connections {base_us:5.2f}, with a prefix "
        f"{sticky_us:5.2f}   prefix hashes ({len(prefix):3} blocks) {hash_us:5.1f}   added {added:+5.1f} "
        f"({added / (parse_us + base_us):.0%} of parse + reserve)"
    )


def micro(repeat: int) -> None:
    """µs per request of what prefix-aware routing adds, against least-connections in the same run."""
    history = [{"role": "system", "content": system_prompt(0, 6000)}]
    for turn in range(9):
        history += [{"role": "user", "content": f"question {turn} " * 20}, {"role": "assistant", "content": "a" * 400}]
    agent = [{"role": "user", "content": f"tool output {i} " * 30} for i in range(200)]
    print(f"CPU per request, µs (best of {repeat} runs):")
    micro_one("chat, 19 messages, 13 KB", {"model": MODEL, "messages": history, "stream": True}, repeat)
    micro_one("agent, 200 messages, 100 KB", {"model": MODEL, "messages": agent, "stream": True}, repeat)
    micro_one("completion, 8 KB prompt", {"model": MODEL, "prompt": system_prompt(1, 8000)}, repeat)
    micro_one("chat, 2 short messages", {"model": MODEL, "messages": history[1:3]}, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--prefix-tokens", type=int, default=1500, help="system prompt size, about (tokens)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2, help="slots per node (--parallel)")
    parser.add_argument("--stagger-s", type=float, default=0.25, help="seconds between conversations' starts")
    parser.add_argument("--think-s", type=float, default=3.0, help="mean seconds between a turn and the next")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=384)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--micro-only", action="store_true")
    args = parser.parse_args()

    micro(args.repeat)
    if args.micro_only:
        return
    installed = LlamaCppInstaller(load_settings().engines.llamacpp).find_installed()
    if installed is None:
        sys.exit("llama-server is not installed: `uv run qiip engine install llama.cpp --cpu`.")
    with tempfile.TemporaryDirectory(prefix="qiip-bench-prefix-") as tmp:
        work = Path(tmp)
        gguf = make_test_gguf(
            work / "bench.gguf", n_layers=args.layers, n_embd=args.embd, n_ff=4 * args.embd, n_ctx_train=4096
        )[0]
        print(
            f"\n{args.conversations} conversations x {args.turns} turns, ~{args.prefix_tokens}-token system prompts, "
            f"{args.max_tokens} tokens per answer, {args.think_s:g} s think time;\n  generated llama GGUF "
            f"({args.layers} layers, {args.embd} wide); "
            f"{args.nodes} nodes behind the daemon, {args.slots} slots and 1 thread each:"
        )
        phases = [
            run_phase(name, work, installed.server, gguf, args)
            for name in ("direct", "least_connections", "prefix_affinity")
        ]
        for phase in phases:
            phase.report()
        direct, least, affinity = phases
        print(
            f"  turns >= 2, TTFT p50: least_connections / prefix_affinity = "
            f"{least.ttft_p50_ms(True) / affinity.ttft_p50_ms(True):.1f}x;   direct (one node) / prefix_affinity = "
            f"{direct.ttft_p50_ms(True) / affinity.ttft_p50_ms(True):.1f}x"
        )


if __name__ == "__main__":
    main()
