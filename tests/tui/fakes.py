"""Canned data for the console's snapshot tests and its benchmark.

Snapshots need the same picture every run, so they drive the console with `FakeClient`, which answers from
fixed `NodeInfo`s; every behaviour test drives it against a real daemon instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from qiip_core.client import (
    ApiError,
    ChatDelta,
    ClientError,
    LentHosts,
    NodeEvent,
    NodeInfo,
    OperationInfo,
    QuadsView,
)
from qiip_core.deployments import (
    AutoscaleStatus,
    Condition,
    Deployment,
    DeploymentEvent,
    DeploymentStatus,
    ReplicaState,
    ReplicaStatus,
    ResolvedSource,
    Template,
    parse_spec,
)
from qiip_core.recommendations import HostRecommendations, parse_recommendations

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


class FakeClient:
    """A daemon that answers from memory. Push events with `push()`; streams end when the fake is closed."""

    def __init__(
        self,
        nodes: Sequence[NodeInfo] = (),
        *,
        url: str = "http://127.0.0.1:8080",
        metrics: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        models: Sequence[str] = ("Qwen/Qwen3-8B", "tiny-chat"),
        answer: Sequence[str] = ("Hello", ", operator", ". All", " nodes", " are", " fine."),
        fail: ClientError | None = None,
    ) -> None:
        self.url = url
        self.nodes_by_id = {n.id: n for n in nodes}
        # One payload, or successive polls' payloads (the last one repeats).
        self.metrics_payloads = [dict(metrics)] if isinstance(metrics, Mapping) else [dict(m) for m in metrics or [{}]]
        self.model_ids = list(models)
        self.answer = list(answer)
        self.answered_by = "gpu01"
        """The node the chat's answers name (`ChatDelta.node`)."""
        self.fail = fail
        self.events_queue: asyncio.Queue[NodeEvent | None] = asyncio.Queue()
        self.relaunched: list[tuple[str, dict[str, Any]]] = []

    def push(self, change: str, info: NodeInfo) -> None:
        """Emit a node event (and apply it to the fake's own view)."""
        if change == "removed":
            self.nodes_by_id.pop(info.id, None)
        else:
            self.nodes_by_id[info.id] = info
        self.events_queue.put_nowait(NodeEvent.model_validate({"change": change, "node": info.model_dump()}))

    def _check(self) -> None:
        if self.fail is not None:
            raise self.fail

    async def nodes(self) -> list[NodeInfo]:
        self._check()
        return list(self.nodes_by_id.values())

    async def node(self, node_id: str) -> NodeInfo:
        self._check()
        return self.nodes_by_id[node_id]

    def _operation(self, kind: str, node_id: str) -> OperationInfo:
        return OperationInfo(id=f"op_{kind}_{node_id}", kind=kind, node_id=node_id, state="running")

    async def drain(self, node_id: str, *, timeout_s: float | None = None) -> OperationInfo:
        return self._operation("drain", node_id)

    async def undrain(self, node_id: str) -> NodeInfo:
        return self.nodes_by_id[node_id]

    async def remove(self, node_id: str, *, force: bool = False) -> OperationInfo:
        return self._operation("remove", node_id)

    async def relaunch(self, node_id: str, policy: Mapping[str, Any]) -> OperationInfo:
        self.relaunched.append((node_id, dict(policy)))
        return self._operation("relaunch", node_id)

    async def operation(self, operation_id: str) -> OperationInfo:
        kind, node_id = operation_id.removeprefix("op_").split("_", 1)
        return OperationInfo(id=operation_id, kind=kind, node_id=node_id, state="succeeded")

    async def metrics(self) -> dict[str, Any]:
        self._check()
        payload = self.metrics_payloads[0] if len(self.metrics_payloads) == 1 else self.metrics_payloads.pop(0)
        return dict(payload)

    async def events(self, *, heartbeat_s: float = 15.0) -> AsyncIterator[NodeEvent]:
        self._check()
        for info in list(self.nodes_by_id.values()):
            yield NodeEvent(change="added", node=info)
        while (event := await self.events_queue.get()) is not None:
            yield event

    def end_events(self) -> None:
        """End the event stream, as a daemon that went away does."""
        self.events_queue.put_nowait(None)

    async def models(self) -> list[str]:
        self._check()
        return list(self.model_ids)

    async def chat_stream(
        self, model: str, messages: Sequence[Mapping[str, str]], *, max_tokens: int | None = None
    ) -> AsyncIterator[ChatDelta]:
        self._check()
        for index, piece in enumerate(self.answer):
            yield ChatDelta(content=piece, node=self.answered_by if index == 0 else None)
        yield ChatDelta(finish_reason="stop", completion_tokens=len(self.answer))

    async def aclose(self) -> None:
        return None


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


class FakeModelsClient(FakeClient):
    """A `FakeClient` whose daemon has the models API, answering `SAMPLE_CATALOG` and `SAMPLE_DOWNLOADS`."""

    async def catalog(self) -> dict[str, Any]:
        self._check()
        return SAMPLE_CATALOG

    async def downloads(self) -> list[dict[str, Any]]:
        self._check()
        return SAMPLE_DOWNLOADS

    async def start_download(
        self, repo_id: str, *, revision: str | None = None, files: Sequence[str] = ()
    ) -> dict[str, Any]:
        self._check()
        return {**SAMPLE_DOWNLOADS[0], "repo_id": repo_id, "revision": revision or "main"}


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


class FakeProvisioningClient(FakeClient):
    """A `FakeClient` whose daemon provisions: `SAMPLE_TASKS`, and `sample_host_log` for each host's log."""

    async def provisioning_tasks(self) -> list[dict[str, Any]]:
        self._check()
        return SAMPLE_TASKS

    async def host_log(self, host: str, *, follow: bool = True) -> AsyncIterator[dict[str, Any]]:
        for entry in sample_host_log(host):
            yield entry

    async def setup(self, body: Mapping[str, Any]) -> OperationInfo:
        return self._operation("setup", str(body["hostname"]))

    async def cancel_provisioning(self, host: str) -> OperationInfo:
        return self._operation("cancel", host)

    async def power(self, host: str, action: str) -> dict[str, Any]:
        return {"host": host, "power_state": "On"}

    async def power_state(self, host: str) -> dict[str, Any]:
        return {"host": host, "system_id": "1", "power_state": "On"}


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


class FakeLogsClient(FakeProvisioningClient):
    """A `FakeProvisioningClient` with the journal (`sample_journal`) and engine logs (`sample_engine_log`)."""

    async def journal(self, *, follow: bool = True) -> AsyncIterator[dict[str, Any]]:
        for entry in sample_journal():
            yield entry

    async def engine_log(self, node_id: str, *, lines: int = 200, follow: bool = True) -> AsyncIterator[dict[str, Any]]:
        for item in sample_engine_log(node_id)[-lines:]:
            yield item


LLMFIT_OUTPUT = Path(__file__).parents[1] / "core" / "recommendations" / "llmfit-recommend-apple-m3-max-128gb.json"
"""llmfit 1.1.17's real `recommend --json` for a GPU profile (the core tests' fixture)."""


class FakeRecommendationsClient(FakeClient):
    """A `FakeClient` whose daemon runs llmfit: every host gets llmfit's real answer for a GPU profile, with the
    first recommendation's repository, and a GGUF repository of the first that names some, in the catalog."""

    async def recommendations(
        self, host: str, *, profile: str | None = None, limit: int | None = None, timeout_s: float = 330.0
    ) -> HostRecommendations:
        self._check()
        found = parse_recommendations(LLMFIT_OUTPUT.read_text(), host=host, profile=profile)
        picked = list(found.recommendations)
        picked[0] = picked[0].model_copy(update={"in_catalog": True})
        i = next(i for i, r in enumerate(picked) if r.gguf_sources)
        held = picked[i].gguf_sources[0].model_copy(update={"in_catalog": True})
        picked[i] = picked[i].model_copy(update={"gguf_sources": (held, *picked[i].gguf_sources[1:])})
        return found.model_copy(update={"recommendations": tuple(picked[: limit or len(picked)])})


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


class FakeQuadsClient(FakeClient):
    """A `FakeClient` whose daemon reads QUADS: `sample_quads_fleet` with `SAMPLE_LENT`."""

    def __init__(self, *, stale_age_s: float | None = None) -> None:
        super().__init__(sample_quads_fleet(), metrics=SAMPLE_METRICS)
        self.lent = SAMPLE_LENT
        if stale_age_s is not None:
            assert SAMPLE_LENT.freshness is not None
            freshness = SAMPLE_LENT.freshness.model_copy(update={"stale": True, "age_s": stale_age_s})
            self.lent = SAMPLE_LENT.model_copy(update={"freshness": freshness})

    async def lent_hosts(self) -> LentHosts:
        self._check()
        return self.lent


def _template(artifact: str, describe: str) -> Template:
    return Template(
        engine="llama_cpp",
        source=ResolvedSource(model=f"models--org--coder/{describe}", artifact_id=artifact * 16, describe=describe),
        written={"artifact": artifact * 2},
    )


def sample_deployments() -> list[dict[str, Any]]:
    """Three deployments as `GET /admin/deployments` answers, built from the core's records: `coder` serves all
    three replicas with autoscaling active (the metric above target, 4 recommended) and an earlier template;
    `embed` has one replica of two still provisioning, its newest generation not yet observed; `big` fits no host.
    """
    at = OBSERVED
    current, earlier = (
        _template("4f1c", "artifact 4f1c4f1c4f1c (org/coder@1a2b3c4 coder-q4_k_m.gguf)"),
        _template("9e0f", "artifact 9e0f9e0f9e0f (org/coder@0f9e8d7 coder-q4_k_m.gguf)"),
    )
    coder = Deployment(
        spec=parse_spec(
            {
                "name": "coder",
                "source": {"artifact": "4f1c4f1c"},
                "replicas": 3,
                "autoscale": {"mode": "active", "min": 1, "max": 4, "target": 0.8},
            }
        ),
        generation=4,
        template=current,
        history=(earlier,),
        created_at=at - timedelta(days=2),
        updated_at=at - timedelta(minutes=30),
    )
    events = [
        ("placed", "gpu01", "placed a replica of template {t} on gpu01 (score 62.3)"),
        ("provisioning", "gpu01", "setup of gpu01: step llama_cpp_install"),
        ("healthy", "gpu01", "gpu01 serves coder"),
        ("scaled", None, "scaled from 2 to 3 replicas: in_flight_per_slot 1.10 above target 0.8 for 30 s"),
        ("healthy", "gpu02", "gpu02 serves coder"),
        ("failed", "gpu07", "setup of gpu07 failed at waiting_for_ssh: SSH on gpu07:22 did not answer within 300 s"),
        ("healthy", "gpu03", "gpu03 serves coder"),
    ]
    samples = [0.35, 0.4, 0.52, 0.6, 0.71, 0.78, 0.86, 0.95, 1.02, 1.1, 1.18, 1.21, 1.15, 1.24, 1.3, 1.26]
    coder_status = DeploymentStatus(
        name="coder",
        observed_generation=4,
        desired=3,
        ready=3,
        updated=3,
        available=3,
        replicas=tuple(
            ReplicaStatus(host=h, template=current.hash, state=ReplicaState.READY, since=at - timedelta(minutes=m))
            for h, m in (("gpu01", 50), ("gpu02", 40), ("gpu03", 12))
        ),
        conditions=(
            Condition(type="Available", status=True, reason="MinimumReplicasAvailable"),
            Condition(type="Progressing", status=True, reason="NewReplicasAvailable"),
            Condition(type="Degraded", status=False, reason="AllReplicasReady"),
        ),
        events=tuple(
            DeploymentEvent(
                at=at - timedelta(minutes=60 - 7 * i), kind=k, host=h, message=m.format(t=current.hash), seq=i + 1
            )
            for i, (k, h, m) in enumerate(events)
        ),
        autoscale=AutoscaleStatus(
            desired=3,
            recommendation=4,
            metric=samples[-1],
            samples=tuple((at.timestamp() - 10 * (len(samples) - i), v) for i, v in enumerate(samples)),
            reason="in_flight_per_slot 1.26 above 0.8 for 30 s",
        ),
        updated_at=at,
    )
    embed = Deployment(
        spec=parse_spec({"name": "embed", "source": {"artifact": "a0b1a0b1"}, "replicas": 2}),
        generation=3,
        template=_template("a0b1", "artifact a0b1a0b1a0b1 (org/embed@5e6f7a8 embed-f16.gguf)"),
    )
    embed_status = DeploymentStatus(
        name="embed",
        observed_generation=2,
        desired=2,
        ready=1,
        updated=2,
        available=1,
        replicas=(
            ReplicaStatus(host="cpu01", template=embed.template.hash, state=ReplicaState.READY, since=at),
            ReplicaStatus(
                host="gpu06",
                template=embed.template.hash,
                state=ReplicaState.PROVISIONING,
                since=at,
                reason="step llama_cpp_install",
            ),
        ),
        conditions=(
            Condition(type="Available", status=True, reason="MinimumReplicasAvailable"),
            Condition(type="Progressing", status=True, reason="ReplicasUpdating"),
            Condition(type="Degraded", status=True, reason="ReplicasStarting", message="1 of 2 ready"),
        ),
        updated_at=at,
    )
    big = Deployment(
        spec=parse_spec({"name": "big", "source": {"artifact": "5d1f5d1f"}, "replicas": 1}),
        template=_template("5d1f", "artifact 5d1f5d1f5d1f (google/gemma-3-270m-GGUF@0123456 gemma.gguf)"),
    )
    big_status = DeploymentStatus(
        name="big",
        observed_generation=1,
        desired=1,
        conditions=(
            Condition(type="Available", status=False, reason="MinimumReplicasUnavailable", message="0 of 1 ready"),
            Condition(type="Progressing", status=True, reason="ReplicasUpdating"),
            Condition(
                type="Degraded",
                status=True,
                reason="NoFittingHost",
                message="No host of the pool can take a replica (qiip deploy explain big says why for each).",
            ),
        ),
        updated_at=at,
    )
    return [
        {**d.view(), "status": s.view()} for d, s in ((big, big_status), (coder, coder_status), (embed, embed_status))
    ]


class FakeDeploymentsClient(FakeClient):
    """A `FakeClient` whose daemon has deployments (`sample_deployments`). Scale, undo and delete are recorded in
    `changes`; a count above 1,000 is refused as the daemon refuses it; `push_event` adds a live event."""

    def __init__(self, nodes: Sequence[NodeInfo] = (), **kwargs: Any) -> None:
        super().__init__(nodes, **kwargs)
        self.found = sample_deployments()
        self.changes: list[tuple[str, str, Any]] = []
        self.live: dict[str, asyncio.Queue[dict[str, Any] | None]] = {}
        self.followed: list[str] = []
        """The deployments whose events were asked for, in order."""

    def push_event(self, name: str, kind: str, message: str, *, host: str | None = None) -> None:
        """A new event of `name`, as the daemon streams it to followers."""
        event = {"at": OBSERVED.isoformat(), "kind": kind, "message": message, "host": host, "seq": 1000}
        self.live.setdefault(name, asyncio.Queue()).put_nowait(event)

    def _named(self, name: str) -> dict[str, Any]:
        for found in self.found:
            if found["name"] == name:
                return found
        raise ApiError(
            f"No deployment named {name!r}.", status=404, code="deployment_not_found", violations=[], param=None
        )

    async def deployments(self) -> list[dict[str, Any]]:
        self._check()
        return [dict(d) for d in self.found]

    async def deployment_events(
        self, name: str, *, follow: bool = True, after: int = 0
    ) -> AsyncIterator[dict[str, Any]]:
        self.followed.append(name)
        for event in (self._named(name).get("status") or {}).get("events", []):
            if event["seq"] > after:
                yield event
        queue = self.live.setdefault(name, asyncio.Queue())
        while follow and (event := await queue.get()) is not None:
            yield event

    async def scale_deployment(self, name: str, replicas: int, *, generation: int | None = None) -> dict[str, Any]:
        found = self._named(name)
        if not 0 <= replicas <= 1000:
            message = f"replicas must be a whole number from 0 to 1000, got {replicas}."
            raise ApiError(
                f"replicas: {message}",
                status=422,
                code="invalid_deployment",
                violations=[{"field": "replicas", "message": message}],
                param="replicas",
            )
        self.changes.append(("scale", name, replicas))
        return {**found, "generation": found["generation"] + 1}

    async def rollout_undo(self, name: str) -> dict[str, Any]:
        found = self._named(name)
        self.changes.append(("undo", name, None))
        return {**found, "template": found["history"][0], "generation": found["generation"] + 1}

    async def delete_deployment(self, name: str) -> dict[str, Any]:
        found = self._named(name)
        self.changes.append(("delete", name, None))
        return {**found, "deleting": True}
