"""The autoscaling policy over a day of generated load: replica-hours used against requests that waited.

The load is generated (and the same for a given `--seed`): a diurnal request rate, low at night and peaking in the
working day, `rate(t) = base + peak × max(0, sin(π (h − 7) / 12))^2` requests/s for the hour of day `h` (0 outside
07:00–19:00), with Poisson arrivals each second, and two bursts of a coding-agent queue (10:00 and 14:30, five
minutes at three times the rate of the hour). Each request holds one llama.cpp slot for an exponentially distributed
time (mean `--service-s`).

The fleet is an IN-MEMORY STAND-IN: each replica has `--slots` slots and is ready `--launch-s` after the controller
asks for it (a launch on a host that has the engine and the model already); a replica told to go stops taking
requests at once and leaves once its requests finished (drain first). A request waits at the gateway while every
slot is busy (or no replica serves), first come first served.

The policy is the real one (`qiip_core.deployments.autoscale`) with the deployment's `[autoscale]` settings, stepped
every `--interval-s` as the controller does. Compared, in the same run: a fixed fleet of `max` replicas (no wait
beyond what max capacity gives, the most replica-hours) and a fixed fleet of `min` replicas (the fewest).

    uv run python bench/autoscale.py [--seed 7] [--min 1] [--max 8] [--slots 4] [--service-s 8]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qiip_core.deployments import AutoscaleStatus, Demand, autoscale  # noqa: E402
from qiip_core.deployments._spec import Autoscale  # noqa: E402

DAY_S = 86_400


def rate(second: int, base: float, peak: float) -> float:
    """Requests per second at `second` of the day (see the module's docstring)."""
    hour = second / 3600
    wave = math.sin(math.pi * (hour - 7) / 12) if 7 <= hour <= 19 else 0.0
    value = base + peak * max(0.0, wave) ** 2
    if 10 * 3600 <= second < 10 * 3600 + 300 or 14.5 * 3600 <= second < 14.5 * 3600 + 300:
        value *= 3
    return value


@dataclass
class Replica:
    ready_at: float
    busy: list[float] = field(default_factory=list)
    """The times its slots free up."""
    leaving: bool = False


@dataclass
class Result:
    name: str
    replica_hours: float = 0.0
    requests: int = 0
    waited: int = 0
    waits: list[float] = field(default_factory=list)
    max_queue: int = 0
    max_replicas: int = 0


def simulate(name: str, args: argparse.Namespace, policy: Autoscale | None, fixed: int | None) -> Result:
    arrivals = random.Random(args.seed)  # the same requests for every fleet
    service = random.Random(args.seed + 1)
    start = datetime(2026, 12, 1, tzinfo=UTC)
    replicas = [Replica(ready_at=0.0) for _ in range(fixed if fixed is not None else args.min)]
    state = AutoscaleStatus()
    desired = len(replicas)
    queue: deque[float] = deque()
    result = Result(name)
    last_request: float | None = None
    for second in range(DAY_S):
        now = float(second)
        for _ in range(_poisson(arrivals, rate(second, args.base, args.peak))):
            queue.append(now)
            result.requests += 1
            last_request = now
        for r in replicas:
            r.busy = [t for t in r.busy if t > now]
        replicas = [r for r in replicas if not (r.leaving and not r.busy)]
        serving = [r for r in replicas if r.ready_at <= now and not r.leaving]
        for r in serving:
            while queue and len(r.busy) < args.slots:
                arrived = queue.popleft()
                wait = now - arrived
                if wait > 0:
                    result.waited += 1
                    result.waits.append(wait)
                r.busy.append(now + service.expovariate(1 / args.service_s))
        result.max_queue = max(result.max_queue, len(queue))
        result.replica_hours += len(replicas) / 3600
        result.max_replicas = max(result.max_replicas, len(replicas))
        if policy is None or second % args.interval_s:
            continue
        demand = Demand(
            in_flight=sum(len(r.busy) for r in serving),
            queued=len(queue),
            slots=len(serving) * args.slots,
            last_request_at=start + timedelta(seconds=last_request) if last_request is not None else None,
        )
        state = autoscale(
            policy, state, demand=demand, replicas=desired, ready=len(serving), now=start + timedelta(seconds=now)
        )
        if state.desired is not None and state.desired != desired:
            desired = state.desired
        staying = [r for r in replicas if not r.leaving]
        if len(staying) < desired:
            replicas += [Replica(ready_at=now + args.launch_s) for _ in range(desired - len(staying))]
        for r in sorted(staying, key=lambda r: len(r.busy))[: max(0, len(staying) - desired)]:
            r.leaving = True
    return result


def _poisson(rng: random.Random, lam: float) -> int:
    if lam <= 0:
        return 0
    threshold, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= threshold:
            return k
        k += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--base", type=float, default=0.002, help="requests/s at night")
    parser.add_argument("--peak", type=float, default=1.5, help="requests/s added at the day's peak")
    parser.add_argument("--slots", type=int, default=4, help="slots per replica")
    parser.add_argument("--service-s", type=float, default=8.0, help="mean seconds a request holds its slot")
    parser.add_argument("--launch-s", type=float, default=20.0, help="seconds from the decision to a ready replica")
    parser.add_argument("--interval-s", type=int, default=2, help="seconds between controller passes")
    parser.add_argument("--min", type=int, default=1)
    parser.add_argument("--max", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.8, help="requests in flight per slot")
    args = parser.parse_args()
    policy = Autoscale(
        min=args.min, max=args.max, metric="in_flight_per_slot", target=args.target, up_window_s=30,
        down_window_s=300, cooldown_s=60, mode="active",
    )  # fmt: skip
    zero = policy.model_copy(update={"min": 0})
    rows = [
        simulate(f"fixed max ({args.max})", args, None, args.max),
        simulate(f"fixed min ({args.min})", args, None, args.min),
        simulate("autoscaled", args, policy, None),
        simulate("autoscaled, min 0", args, zero, None),
    ]
    base = rows[0]
    print(
        f"{'fleet':<20} {'replica-h':>9} {'x max':>6} {'requests':>8} {'waited':>7} {'% waited':>8} "
        f"{'wait p95 s':>10} {'max queue':>9} {'peak':>4}"
    )
    for row in rows:
        waits = sorted(row.waits)
        p95 = waits[int(0.95 * (len(waits) - 1))] if waits else 0.0
        share = 100 * row.waited / max(1, row.requests)
        print(
            f"{row.name:<20} {row.replica_hours:>9.1f} {row.replica_hours / base.replica_hours:>6.2f} "
            f"{row.requests:>8} {row.waited:>7} {share:>7.2f}% {p95:>10.1f} {row.max_queue:>9} {row.max_replicas:>4}"
        )


if __name__ == "__main__":
    main()
