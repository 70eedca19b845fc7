"""The cost of one reading: the gateway's strict parse of a request body against a plain `json.loads`, in one run.

`qiip_proxy._strict_json.strict_loads` refuses what two parsers may read differently (duplicate keys, non-UTF-8,
case-folded member names, NaN, overflowing numbers, lone surrogates). This times it and `json.loads` on the same
bodies, best of `--rounds` repeats of `--loops` parses each, and prints µs per parse and the ratio:

- `chat-small`: one short user message, the commonest request;
- `chat-20`: twenty messages with emoji written as escaped surrogate pairs (Python's `json.dumps` default), which
  makes the strict parse walk every string;
- `embeddings-2k`: 2,000 token ids;
- `keys-1mib`: an object of 1 MiB of members (the costliest body per byte within the gateway's bounds).

    uv run python bench/strict_json.py [--rounds 5] [--loops 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qiip_proxy._strict_json import strict_loads


def bodies() -> dict[str, tuple[bytes, int]]:
    """The bodies by name, each with its loop divisor (large bodies run fewer loops)."""
    turns = [{"role": "user" if i % 2 else "assistant", "content": f"turn {i} 😀 " + "words " * 40} for i in range(20)]
    return {
        "chat-small": (
            json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hello!"}], "stream": True}).encode(),
            1,
        ),
        "chat-20": (json.dumps({"model": "m", "messages": turns, "max_tokens": 256, "temperature": 0.7}).encode(), 4),
        "embeddings-2k": (json.dumps({"model": "m", "input": list(range(2000))}).encode(), 4),
        "keys-1mib": (b'{"model": "m", "x": {' + b",".join(b'"k%d": 0' % i for i in range(65_536)) + b"}}", 200),
    }


def best_us(parse: Callable[[bytes], object], body: bytes, loops: int, rounds: int) -> float:
    """The best of `rounds` timings of `loops` parses, in µs per parse."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(loops):
            parse(body)
        best = min(best, (time.perf_counter() - started) / loops)
    return best * 1e6


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loops", type=int, default=200)
    args = parser.parse_args()
    print(f"{'body':14} {'bytes':>9} {'json.loads µs':>14} {'strict µs':>10} {'added µs':>9} {'ratio':>6}")
    for name, (body, divisor) in bodies().items():
        loops = max(1, args.loops // divisor)
        plain = best_us(json.loads, body, loops, args.rounds)
        strict = best_us(strict_loads, body, loops, args.rounds)
        print(f"{name:14} {len(body):9} {plain:14.1f} {strict:10.1f} {strict - plain:9.1f} {strict / plain:6.2f}")


if __name__ == "__main__":
    main()
