"""Canned data of the console's snapshot tests and its benchmark: a fleet of nodes in most states, two polls of
its metrics, a model catalog and downloads, provisioning tasks and host logs, the journal and an engine log,
llmfit's answer, and the hosts QUADS lends.

Snapshots need the same picture every run, so every value here is fixed, times included (`OBSERVED`,
`QUADS_NOW`); the fake daemons (`fakes`) answer with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from qiip_core.client import LentHosts, NodeInfo, QuadsView

OBSERVED = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)


def runtime(
    *,
    sizing: str = "auto",
    context_per_slot: int = 8192,
    slots: int = 4,
    cache: str = "f16",
    train: int = 32768,
    gpus: Sequence[tuple[int, int]] = ((61000, 81920),),
    cpu: bool = False,
) -> dict[str, Any]:
    """A `llamacpp_runtime` record."""
    requested: dict[str, Any] = {"sizing": sizing, "fit_target_mib": 512}
    if sizing == "custom":
        requested |= {"context_per_slot": context_per_slot, "slots": slots, "cache_type": cache}
    return {
        "requested": requested,
        "effective": {
            "train_context": train,
            "context_per_slot": context_per_slot,
            "slot_context_limit": context_per_slot,
            "slots": slots,
            "aggregate_context": context_per_slot * slots,
            "cache_type_k": cache,
            "cache_type_v": cache,
            "flash_attn": "auto" if cache == "f16" else "on",
            "kv_unified": True,
            "gpu_layers": 0 if cpu else 37,
            "total_layers": 37,
            "estimator_overrun_used": False,
            "device_mode": "cpu" if cpu else "gpu",
        },
        "gpus": [
            {"index": i, "total_mib": total, "used_mib": used, "free_mib": total - used}
            for i, (used, total) in enumerate(gpus)
        ],
        "observed_at": OBSERVED.isoformat(),
    }


def node(node_id: str, *, status: str = "healthy", model: str = "Qwen/Qwen3-8B", **fields: Any) -> NodeInfo:
    """A node with sensible defaults."""
    data: dict[str, Any] = {
        "id": node_id,
        "endpoint": f"http://{node_id}.lab:8000",
        "status": status,
        "model": model,
        "engine": "llama_cpp",
        "managed": True,
        "source": "local",
        "last_heartbeat": OBSERVED.isoformat(),
    }
    data.update(fields)
    return NodeInfo.model_validate(data)


def ollama_node() -> NodeInfo:
    """An Ollama server's model registered as a node, loaded partly on the CPU."""
    resident = [
        {"name": "qwen2.5:14b", "size_bytes": 10_737_418_240, "vram_bytes": 7_516_192_768, "context_length": 4096},
    ]
    return node(
        "lab-ollama",
        model="qwen2.5:14b",
        engine="ollama",
        managed=False,
        source="state",
        endpoint="http://lab-ollama.lab:11434",
        resident=resident,
    )


def sample_fleet() -> list[NodeInfo]:
    """Eight nodes in most states a fleet shows."""
    return [
        node("gpu01", in_flight=3, llamacpp_runtime=runtime(gpus=((61000, 81920), (59000, 81920)))),
        node("gpu02", in_flight=1, llamacpp_runtime=runtime(sizing="custom", cache="q8_0", slots=2)),
        node("gpu03", status="draining", in_flight=2, llamacpp_runtime=runtime(gpus=((40100, 81920),))),
        node(
            "gpu04",
            status="unhealthy",
            breaker={"state": "open", "consecutive_failures": 5},
            last_error="connect failed: connection refused",
            last_error_at="2026-11-29T12:02:00+00:00",
            recent_errors=[
                {
                    "at": "2026-11-29T12:02:00+00:00",
                    "first_at": "2026-11-29T12:01:10+00:00",
                    "status": None,
                    "error": "connect failed: connection refused",
                    "count": 4,
                },
                {"at": "2026-11-29T11:58:30+00:00", "status": 503, "error": "the node answered HTTP 503.", "count": 1},
            ],
            llamacpp_runtime=runtime(gpus=((12000, 24576),)),
        ),
        node("gpu05", status="relaunching", model="meta/Llama-3.1-70B", llamacpp_runtime=None),
        node("vllm01", engine="vllm", managed=False, source="etcd", model="meta/Llama-3.1-70B", in_flight=7),
        node("vllm02", engine="vllm", managed=False, source="etcd", status="unknown", model="meta/Llama-3.1-70B"),
        node(
            "cpu01",
            model="tiny-chat",
            llamacpp_runtime=runtime(
                sizing="custom", context_per_slot=2048, slots=2, train=2048, cpu=True, gpus=((950, 24105),)
            ),
        ),
    ]


def _counts(requests: int, failures: int, retries: int, tokens: int, **extra: float) -> dict[str, float]:
    return {
        "requests": requests,
        "errors": failures,
        "retries": retries,
        "failures": failures,
        "attempts": requests + failures,
        "prompt_tokens": 40 * requests,
        "completion_tokens": tokens,
        **extra,
    }


SAMPLE_METRICS: tuple[dict[str, Any], ...] = (
    {
        "by_model": {"Qwen/Qwen3-8B": {"requests": 1200, "errors": 3}, "meta/Llama-3.1-70B": {"requests": 300}},
        "by_node": {
            "gpu01": _counts(700, 0, 0, 90_000, ttft_p50_s=0.182, ttft_p95_s=0.41),
            "gpu02": _counts(500, 3, 1, 60_000, ttft_p50_s=1.25, ttft_p95_s=2.9),
            "gpu04": _counts(40, 20, 20, 1_000),
            "vllm01": _counts(300, 0, 0, 50_000, ttft_p50_s=0.35, ttft_p95_s=0.8),
        },
    },
    {
        "by_model": {
            "Qwen/Qwen3-8B": {"requests": 1260, "errors": 4},
            "meta/Llama-3.1-70B": {"requests": 300, "errors": 2},
        },
        "by_node": {
            "gpu01": _counts(740, 0, 0, 95_200, ttft_p50_s=0.182, ttft_p95_s=0.41),
            "gpu02": _counts(520, 4, 2, 62_400, ttft_p50_s=1.25, ttft_p95_s=2.9),
            "gpu04": _counts(40, 25, 25, 1_000),
            "vllm01": _counts(300, 0, 0, 50_000, ttft_p50_s=0.35, ttft_p95_s=0.8),
        },
    },
)
"""Two polls of `/admin/metrics`, five seconds apart on the snapshot console's clock: gpu01 serves 8 req/s,
gpu02 4 req/s with one failure in 21, gpu04 only fails, vllm01 is idle."""


SAMPLE_CATALOG: dict[str, Any] = {
    "cache_dir": "/srv/hf/hub",
    "exists": True,
    "degraded": True,
    "counters": {"incomplete": 1, "unverifiable": 0, "invalid": 0, "corrupted": 1},
    "repos": 3,
    "files": 7,
    "gguf": [
        {
            "artifact_id": "5d1f" * 16,
            "repo_id": "google/gemma-3-270m-GGUF",
            "revision": "0123456789abcdef0123456789abcdef01234567",
            "refs": ["main"],
            "entrypoint": "gemma-3-270m-q4_k_m.gguf",
            "files": ["gemma-3-270m-q4_k_m.gguf"],
            "size_bytes": 253_113_024,
            "architecture": "gemma3",
            "quantization": "Q4_K_M",
            "context_length": 32768,
            "modelled": True,
            "verifiable": True,
            "nodes": ["gpu01", "gpu02"],
        },
        {
            "artifact_id": "a0b1" * 16,
            "repo_id": "ibm/granite-GGUF",
            "revision": "b" * 40,
            "refs": [],
            "entrypoint": "Q8_0/granite-00001-of-00002.gguf",
            "files": ["Q8_0/granite-00001-of-00002.gguf", "Q8_0/granite-00002-of-00002.gguf"],
            "size_bytes": 3_400_000_000,
            "architecture": "granite",
            "quantization": "Q8_0",
            "context_length": 131072,
            "modelled": False,
            "verifiable": True,
            "nodes": [],
        },
    ],
    "full": [],
    "issues": [],
}
"""A degraded catalog with two generations, one served by two nodes."""


SAMPLE_DOWNLOADS: list[dict[str, Any]] = [
    {
        "id": "dl_1",
        "repo_id": "Qwen/Qwen3-8B-GGUF",
        "revision": "main",
        "files": ["Qwen3-8B-Q4_K_M.gguf"],
        "state": "running",
        "commit": "c" * 40,
        "bytes_done": 2_000_000_000,
        "bytes_total": 5_000_000_000,
        "rate_bytes_per_s": 104_857_600.0,
        "eta_s": 28.6,
        "error": None,
    },
    {
        "id": "dl_0",
        "repo_id": "org/absent",
        "revision": "main",
        "files": [],
        "state": "failed",
        "commit": None,
        "bytes_done": 0,
        "bytes_total": None,
        "rate_bytes_per_s": 0.0,
        "eta_s": 0.0,
        "error": "The hub has no repository org/absent (or it is private).",
    },
]


SAMPLE_TASKS: list[dict[str, Any]] = [
    {
        "hostname": "gpu03",
        "kind": "setup",
        "state": "running",
        "current_step": "vllm_install",
        "engine": "vllm",
        "model": "Qwen/Qwen3-8B",
        "failed_step": None,
        "error": None,
        "elapsed_s": 312.4,
    },
    {
        "hostname": "gpu04",
        "kind": "setup",
        "state": "failed",
        "current_step": "waiting_for_ssh",
        "engine": "llama_cpp",
        "model": "tiny.gguf",
        "failed_step": "waiting_for_ssh",
        "error": "SSH on gpu04:22 did not answer within 300 s.",
        "elapsed_s": 300.2,
    },
    {
        "hostname": "gpu05",
        "kind": "teardown",
        "state": "succeeded",
        "current_step": "complete",
        "engine": "vllm",
        "model": None,
        "failed_step": None,
        "error": None,
        "elapsed_s": 41.0,
    },
]
"""Every host's last task, as `GET /admin/provisioning/tasks` answers."""


def sample_host_log(host: str) -> list[dict[str, Any]]:
    """A host's log entries, as `GET /admin/provisioning/{host}/logs` streams them."""
    lines = [
        ("info", "gateway", "pending", f"setup of vllm serving 'Qwen/Qwen3-8B' by gw1:8080 on {host}"),
        ("info", "gateway", "waiting_for_ssh", "step waiting_for_ssh"),
        ("info", "gateway", "preflight", "step preflight"),
        ("info", "stdout", "preflight", "free disk under /opt: 412 GiB"),
        ("warning", "stderr", "preflight", "swap is enabled; vLLM prefers it off"),
        ("info", "gateway", "vllm_install", "step vllm_install"),
        ("info", "stdout", "vllm_install", "Collecting vllm==0.11.0"),
        ("debug", "stdout", "vllm_install", "Downloading torch-2.8.0-cp311-cp311-manylinux_2_28_x86_64.whl"),
    ]
    return [
        {
            "ts": f"2026-11-29T12:0{i // 6}:{(i * 7) % 60:02d}+00:00",
            "level": level,
            "msg": msg,
            "stream": stream,
            "step": step,
        }
        for i, (level, stream, step, msg) in enumerate(lines)
    ]


def sample_journal() -> list[dict[str, Any]]:
    """A fleet journal: nodes joining, a drain, a node turning unhealthy and its breaker, at fixed times."""
    rows: list[tuple[str, str, str, str | None, dict[str, Any]]] = [
        ("gpu01", "added", "added as unknown", "registered from etcd", {"to": "unknown"}),
        ("gpu01", "status", "unknown → healthy", "health probe ok", {"from": "unknown", "to": "healthy"}),
        ("gpu02", "added", "added as unknown", "registered from etcd", {"to": "unknown"}),
        ("gpu02", "status", "unknown → healthy", "health probe ok", {"from": "unknown", "to": "healthy"}),
        ("gpu03", "operation_started", "drain started", None, {"operation": "op_1", "kind": "drain"}),
        ("gpu03", "status", "healthy → draining", "drain operation op_1", {"from": "healthy", "to": "draining"}),
        ("gpu03", "operation_succeeded", "drain succeeded", "remaining_in_flight=0, timed_out=False", {}),
        ("gpu02", "breaker_open", "circuit breaker opened", "connect error: connection refused", {}),
        (
            "gpu02",
            "status",
            "healthy → unhealthy",
            "1 failed health probe: GET /health: connection refused",
            {"from": "healthy", "to": "unhealthy"},
        ),
        ("gpu04", "operation_failed", "relaunch failed", "llama-server exited with code 1 while loading", {}),
    ]
    return [
        {
            "seq": i + 1,
            "at": f"2026-11-29T12:{i:02d}:{(i * 13) % 60:02d}+00:00",
            "node": node,
            "event": event,
            "summary": summary,
            "reason": reason,
            **data,
        }
        for i, (node, event, summary, reason, data) in enumerate(rows)
    ]


def sample_engine_log(node_id: str) -> list[dict[str, Any]]:
    """The start of a llama-server's output, as `engine_log` gives it."""
    lines = [
        "build: 6700 (a1b2c3d4) with cc (Debian 12.2.0-14) 12.2.0 for x86_64-linux-gnu",
        "system info: n_threads = 1, n_threads_batch = 1, total_threads = 2",
        f"main: loading model {node_id}",
        "llama_model_loader: loaded meta data with 24 key-value pairs and 12 tensors",
        "llama_context: n_ctx = 2048, n_ctx_per_seq = 1024, n_seq_max = 2",
        "main: server is listening on http://127.0.0.1:18080 - starting the main loop",
        "srv  update_slots: all slots are idle",
    ]
    return [{"event": "line", "line": line} for line in lines]


LLMFIT_OUTPUT = Path(__file__).parents[1] / "core" / "recommendations" / "llmfit-recommend-apple-m3-max-128gb.json"
"""llmfit 1.1.17's real `recommend --json` for a GPU profile (the core tests' fixture)."""


QUADS_NOW = datetime(2026, 11, 29, 12, 5, tzinfo=UTC)
"""The snapshots' time of day, which the QUADS countdowns run to."""


def quads_view(
    host: str, *, gpus: int = 8, product: str = "H100 80GB HBM3", reserved_in: timedelta | None = None
) -> dict[str, Any]:
    """A host's QUADS view (`quads` of a node or of a lent host), reserved from `reserved_in` after `QUADS_NOW`
    for a week, within the 24 h lookahead when that is sooner than a day."""
    start = QUADS_NOW + reserved_in if reserved_in is not None else None
    reservation = (
        {
            "start": start.isoformat(),
            "end": (start + timedelta(days=7)).isoformat(),
            "cloud": "cloud02",
            "owner": "alice",
        }
        if start is not None
        else None
    )
    return {
        "host": host,
        "gpus": {"vendor": "NVIDIA", "product": product, "count": gpus},
        "available": reserved_in is None or reserved_in > timedelta(days=1),
        "next_reservation": reservation,
        "next_conflict_at": start.isoformat() if start is not None else None,
        "conflict_within_lookahead": reserved_in is not None and reserved_in <= timedelta(days=1),
        "teardown_at": max(start - timedelta(days=1), QUADS_NOW).isoformat() if start is not None else None,
        "lookahead_s": 86400.0,
        "data_age_s": 60.0,
        "stale": False,
    }


def sample_quads_fleet() -> list[NodeInfo]:
    """`sample_fleet` on hosts QUADS lends: gpu03 is taken back in 2h 14m, gpu01 in 3 days, gpu02 is free."""
    reserved = {
        "gpu01": timedelta(days=3, hours=1),
        "gpu02": None,
        "gpu03": timedelta(hours=2, minutes=14),
    }
    return [
        n.model_copy(update={"quads": QuadsView.model_validate(quads_view(n.id, reserved_in=reserved[n.id]))})
        if n.id in reserved
        else n
        for n in sample_fleet()
    ]


SAMPLE_LENT = LentHosts.model_validate(
    {
        "hosts": [quads_view("gpu07.lab"), quads_view("gpu08.lab", gpus=4, product="A100 80GB PCIe")],
        "freshness": {"fetched_at": "2026-11-29T12:04:00+00:00", "age_s": 60.0, "stale": False, "hosts": 5},
    }
)
"""QUADS lends five GPU hosts: gpu01–gpu03, nodes, and gpu07, gpu08, not provisioned."""
