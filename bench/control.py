"""What a worker's report costs on the control channel (`qiip_proxy._control`): `encode` in the worker, `decode` in
the primary, and the rows made `Accounted` again, for a report of `--requests` finished requests.

The baseline is the untyped form the report had before its records: `json.dumps` of `{"requests": [...]}`, then
`json.loads` and each row's fields checked and converted in Python, as the primary did. Figures are the best of
`--repeat` runs of `--number` reports each; they move with the machine, the ratio much less.

    uv run python bench/control.py
"""

from __future__ import annotations

import argparse
import functools
import json
import timeit
from typing import Any

from qiip_proxy._control import Report, decode, encode
from qiip_proxy._metrics import Accounted


def finished(count: int) -> list[Accounted]:
    """`count` finished requests, as varied as a busy worker's: streams and not, failovers, usage or none."""
    return [
        Accounted(
            "llama-3.1-8b-instruct",
            f"gpu-node-{i % 8}",
            200 if i % 20 else 502,
            None if i % 20 else "failover_exhausted",
            0.25 + i / 1000,
            0.05 + i / 10_000 if i % 2 else None,
            (("gpu-node-9", "connect"),) if i % 10 == 0 else (),
            None,
            (512 + i, 64) if i % 20 else None,
        )
        for i in range(count)
    ]


def untyped(requests: list[Accounted]) -> list[Accounted]:
    """The baseline: a JSON object of arrays, each checked and converted in Python."""
    line = json.dumps({"requests": requests}).encode() + b"\n"
    message: dict[str, Any] = json.loads(line)
    out = []
    for item in message.get("requests", ()):
        model, node, status, error_code, duration_s, ttft_s, failures, relay_kind, usage = item
        out.append(
            Accounted(
                str(model),
                str(node),
                int(status),
                error_code,
                float(duration_s),
                None if ttft_s is None else float(ttft_s),
                tuple((str(n), str(kind)) for n, kind in failures),
                relay_kind,
                None if usage is None else (int(usage[0]), int(usage[1])),
            )
        )
    return out


def typed(requests: list[Accounted]) -> list[Accounted]:
    """The control channel's way: `encode(Report)`, `decode`, `Accounted._make` of each row."""
    report = decode(encode(Report(requests=tuple(requests))))
    assert isinstance(report, Report)
    return [Accounted._make(row) for row in report.requests]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100, help="finished requests in one report")
    parser.add_argument("--number", type=int, default=2000, help="reports per run")
    parser.add_argument("--repeat", type=int, default=7, help="runs; the best is kept")
    args = parser.parse_args()
    requests = finished(args.requests)
    assert typed(requests) == untyped(requests) == requests
    best: dict[str, float] = {}
    for _ in range(args.repeat):  # interleaved, so both see the same machine
        for name, way in (("untyped", untyped), ("typed", typed)):
            run_s = timeit.timeit(functools.partial(way, requests), number=args.number) / args.number
            best[name] = min(best.get(name, run_s), run_s)
    for name, run_s in best.items():
        print(f"{name:>8}: {run_s * 1e6:8.1f} µs per report of {args.requests} requests (encode + decode)")
    print(f"   ratio: {best['typed'] / best['untyped']:.2f} (typed / untyped; below 1 is faster)")


if __name__ == "__main__":
    main()
