"""Placement at fleet scale: the real deployment controller, scheduler and planner over up to 10,000 hosts.

The provisioning actuator and the fleet it observes are replaced by an IN-MEMORY STAND-IN (`InMemoryFleet`): a
placed replica is `provisioning` for one pass, then ready; a retired one is gone a pass later. Everything else is
the code the daemon runs: `DeploymentController.tick` (observe, reconcile, act, store statuses), `place` (filters,
scores, explain for every host), `PlannerFit` (the planner proving each template fits each kind of host, with the
Python estimator on model shapes of 1B to 70B llama-style models at Q4_K_M and F16).

Fleets of 100, 250, 500 and 1,000 hosts (and 10,000 with `--sizes …,10000`) of mixed GPU kinds (8×H100 80 GB,
8×A100 80 GB, 4×L40S 48 GB, 2×A10 24 GB, 1×T4 16 GB: five host shapes), with one deployment per five hosts (200 at
1,000 hosts, 2,000 at 10,000) of 1–3 replicas, each of one of 7 models and 9 sizings. Printed per size: passes and
seconds (wall and CPU) until every replica is placed and ready, the planner proofs made for it, CPU time of one
steady-state pass (median, max), and each as a ratio to the first size of the same invocation (the 100-host run).
The targets: the first placement at 1,000 hosts within 3 s, every steady pass there within 100 ms of CPU.

The first placement proves its fits over worker processes (`PlannerFit.prove_all`: this one and one more per usable
core but one; `--workers 1` proves them all here): its CPU time is this process's and its workers' together.

    uv run python bench/placement.py [--sizes 100,250,500,1000] [--repeat 5]
    uv run python bench/placement.py --sizes 100,10000 --repeat 3
    uv run python bench/placement.py --sizes 100,1000 --daemon-gc [--workers 1]

The controller runs in the gateway daemon, which tunes CPython's garbage collector once started (`tune_gc`);
`--daemon-gc` does the same here. Without it the collector keeps CPython's defaults, under which full collections
(about 0.1-0.2 s each over this process's objects) add up to a fifth of the first placement and land in a steady
pass now and then.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The planner's worker processes import this script again, as `__mp_main__` (multiprocessing's spawn does so with
# a program's main module), and need none of what it imports: each would spend a second importing it for nothing.
if __name__ != "__mp_main__":
    from qiip_core.deployments import (
        Deployment,
        DeploymentController,
        GpuView,
        HostView,
        PlannerFit,
        ReconcileConfig,
        ReplicaState,
        ResolvedSource,
        Template,
        parse_spec,
    )
    from qiip_core.planner import ModelShape
    from qiip_core.planner._estimate import _compute_buffers
    from qiip_proxy.server._gc import tune_gc
    from tests.support.deployments import AlwaysLeader, InMemoryDeploymentStore, InMemoryFleet

GPU_KINDS = [
    ("NVIDIA H100 80GB HBM3", 81_559, 8),
    ("NVIDIA A100-SXM4-80GB", 81_920, 8),
    ("NVIDIA L40S", 46_068, 4),
    ("NVIDIA A10", 23_028, 2),
    ("Tesla T4", 15_360, 1),
]
MODELS = {  # name: (layers, width, heads, kv heads, ff width, bytes per parameter)
    "1b-q4": (16, 2048, 32, 8, 8192, 0.6),
    "3b-q4": (28, 3072, 24, 8, 8192, 0.6),
    "8b-q4": (32, 4096, 32, 8, 14336, 0.6),
    "8b-f16": (32, 4096, 32, 8, 14336, 2.0),
    "14b-q4": (40, 5120, 40, 8, 13824, 0.6),
    "32b-q4": (64, 5120, 40, 8, 27648, 0.6),
    "70b-q4": (80, 8192, 64, 8, 28672, 0.6),
}


def synthetic_shape(name: str) -> ModelShape:
    """A llama-style model shape of the named size (the planner's input; no file behind it)."""
    layers, width, heads, kv, ff, bpp = MODELS[name]
    vocab = 128_256
    block_params = 2 * width * width + 2 * width * (width * kv // heads) + 3 * width * ff
    embd = int(vocab * width * bpp)
    blocks = tuple(int(block_params * bpp) for _ in range(layers))
    return ModelShape(
        architecture="llama",
        n_layers=layers,
        n_embd=width,
        n_head=heads,
        n_head_kv=kv,
        head_dim_k=width // heads,
        head_dim_v=width // heads,
        n_ff=ff,
        n_ctx_train=32_768,
        n_vocab=vocab,
        weights_bytes=sum(blocks) + 2 * embd,
        block_bytes=blocks,
        token_embd_bytes=embd,
    )


def fleet_hosts(count: int, rng: random.Random) -> list[HostView]:
    hosts = []
    for i in range(count):
        product, memory, per_host = GPU_KINDS[rng.randrange(len(GPU_KINDS))]
        gpus = tuple(GpuView(g, product, memory) for g in range(per_host))
        hosts.append(
            HostView(
                name=f"gpu{i:04d}", origin="config", gpus=gpus, gpus_from="declared", labels={"rack": f"r{i % 20}"}
            )
        )
    return hosts


def deployments(count: int, rng: random.Random) -> list[Deployment]:
    names = list(MODELS)
    found = []
    for i in range(count):
        model = names[rng.randrange(len(names))]
        spec = parse_spec(
            {
                "name": f"model-{i:03d}",
                "source": {"artifact": f"{i:08x}"},
                "replicas": rng.randint(1, 3),
                "runtime": {
                    "capacity": {"sequences": rng.choice([1, 2, 4]), "context_tokens": rng.choice([4096, 8192, 16384])}
                },
            }
        )
        template = Template(
            engine="llama_cpp",
            source=ResolvedSource(model=f"{model}.gguf", artifact_id=f"{i:064x}"),
            runtime=spec.runtime,
        )
        found.append(Deployment(spec=spec, template=template))
    return found


def cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended (the planner's workers, once shut down)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


async def run_size(size: int, seed: int, steady_passes: int, workers: int | None = None) -> dict[str, float]:
    # Every size starts cold: the planner's compute buffers are shared process-wide, and an earlier size of this
    # invocation must not have replayed them for this one.
    _compute_buffers.cache_clear()
    rng = random.Random(seed)
    fleet = InMemoryFleet(fleet_hosts(size, rng))
    store = InMemoryDeploymentStore()
    for deployment in deployments(size // 5, rng):
        await store.write(deployment, expected_generation=None)
    shapes = {name: synthetic_shape(name) for name in MODELS}
    fit = PlannerFit(lambda template: shapes[template.source.model.removesuffix(".gguf")], workers=workers)
    clock_now = [datetime(2026, 12, 1, tzinfo=UTC)]
    controller = DeploymentController(
        store=store,
        observer=fleet,
        actuator=fleet,
        leadership=AlwaysLeader("bench"),
        config=ReconcileConfig(),
        fit=fit,
        clock=lambda: clock_now[0],
    )
    wanted = sum(d.spec.replicas for d in store.records.values())
    started = time.perf_counter()
    cpu_started = cpu_s()
    passes = 0
    while True:
        await controller.tick()
        passes += 1
        fleet.advance()
        clock_now[0] += timedelta(seconds=2)
        ready = sum(1 for r in fleet.replicas.values() if r.state is ReplicaState.READY)
        if ready >= wanted or passes > 50:
            break
    place_s = time.perf_counter() - started
    place_cpu_s = cpu_s() - cpu_started
    samples = []
    for _ in range(steady_passes):
        cpu = time.process_time()
        await controller.tick()
        samples.append(time.process_time() - cpu)
        clock_now[0] += timedelta(seconds=2)
    unplaced = wanted - sum(1 for r in fleet.replicas.values() if r.state is ReplicaState.READY)
    return {
        "hosts": size,
        "deployments": len(store.records),
        "replicas": wanted,
        "unplaced": unplaced,
        "passes": passes,
        "place_s": place_s,
        "place_cpu_s": place_cpu_s,
        "proofs": fit.proved,
        "tick_p50_ms": statistics.median(samples) * 1000,
        "tick_max_ms": max(samples) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,250,500,1000", help="fleet sizes, comma-separated")
    parser.add_argument("--repeat", type=int, default=10, help="steady-state passes measured per size")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes that prove fits, this one included (default: one per usable core; 1: this one alone)",
    )
    parser.add_argument(
        "--daemon-gc",
        action="store_true",
        help="tune the garbage collector as the gateway daemon does once started (tune_gc: start-up objects frozen, "
        "young collections every 20,000 allocations); without it CPython's defaults",
    )
    args = parser.parse_args()
    if args.daemon_gc:
        tune_gc()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = [asyncio.run(run_size(size, args.seed, args.repeat, args.workers)) for size in sizes]
    base = rows[0]
    print(
        f"{'hosts':>6} {'deploy':>6} {'replicas':>8} {'unplaced':>8} {'passes':>6} {'proofs':>6} {'place s':>8} "
        f"{'cpu s':>7} {'x':>6} {'pass p50 ms':>11} {'pass max ms':>11} {'x':>6}"
    )
    for row in rows:
        print(
            f"{row['hosts']:>6} {row['deployments']:>6} {row['replicas']:>8} {row['unplaced']:>8} {row['passes']:>6} "
            f"{row['proofs']:>6} {row['place_s']:>8.2f} {row['place_cpu_s']:>7.2f} "
            f"{row['place_s'] / base['place_s']:>6.1f} {row['tick_p50_ms']:>11.1f} {row['tick_max_ms']:>11.1f} "
            f"{row['tick_p50_ms'] / base['tick_p50_ms']:>6.1f}"
        )
    at_1000 = [row for row in rows if row["hosts"] == 1000]
    for row in at_1000:
        print(
            f"target at 1,000 hosts: first placement within 3 s, {row['place_s']:.2f} s "
            f"({'met' if row['place_s'] <= 3 else 'NOT met'}); every steady pass within 100 ms of CPU, worst "
            f"{row['tick_max_ms']:.1f} ms ({'met' if row['tick_max_ms'] <= 100 else 'NOT met'})"
        )


if __name__ == "__main__":
    main()
