"""Check that a running llama-server is the plan it was launched from, and write the node's runtime record.

After `/health` answers, every planned value is read back from the server itself:

```
/props        total_slots == slots, default_generation_settings.n_ctx == min(train, aggregate), model_alias
/slots        one entry per slot, each n_ctx == min(train, aggregate)
/v1/models    data[0].meta.n_ctx_train == train
server log    initializing, n_slots = S, n_ctx_slot = C, kv_unified = 'true'
              llama_context: n_ctx = A
              every K/V cache: K (t), V (t) are the planned types
              load_tensors: offloaded L/L layers to GPU          (GPU mode; CPU mode has no offload)
              the training-context overflow warnings exactly when A > train; never "failed to fit params"
              each planned cache, by kind, cells and layers:
                llama_kv_cache: size = … (A cells, L layers, …)                     the full-attention cache
                creating SWA KV cache … llama_kv_cache: size = … (W cells, …)       the sliding-window cache
                llama_memory_recurrent: size = … (S cells, L layers, …)             recurrent state
devices       every device keeps at least fit_target_mib free after the load
```

The first difference raises `VerificationError` naming the value, what the plan expected and what the server
said. The log is read at `--log-verbosity 4` (what `qiip_core.engines.llamacpp.launch_spec_for` sets), from the
last run in it. For an architecture whose caches are not modelled (`Plan.memory_known` False) the cache matches
cannot be made: the record lists them in `unverified` and the universal checks still apply, so a correct server
is never refused for a log shape the planner does not know.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from qiip_core._errors import VerificationError
from qiip_core.nodes import LlamaCppRuntime
from qiip_core.planner._plan import Plan
from qiip_core.planner._types import DeviceMemory

__all__ = ["LoggedCache", "ServerLogFacts", "check_log", "parse_server_log", "verify_runtime"]

logger = logging.getLogger("qiip.planner")

_RUN_START = "llama_server: initializing"
"""The first line every llama-server run logs; a log appended across relaunches is read from its last one."""
_SWA_CREATING = re.compile(r"creating\s+(non-SWA|SWA) KV cache")
_RECURRENT_RE = re.compile(
    r"llama_memory_recurrent: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,.*?\), "
    r"R \((\w+)\):\s*([\d.]+) MiB, S \((\w+)\):\s*([\d.]+) MiB"
)
_SLOTS_RE = re.compile(r"initializing, n_slots = (\d+), n_ctx_slot = (\d+), kv_unified = '(\w+)'")
_N_CTX_RE = re.compile(r"llama_context: n_ctx\s+=\s+(\d+)")
_KV_RE = re.compile(
    r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,.*?\), "
    r"K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB"
)
_OFFLOAD_RE = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_COMPUTE_RE = re.compile(r"sched_reserve:\s+(\S+) compute buffer size =\s*([\d.]+) MiB")
_MODEL_RE = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s*([\d.]+) MiB")
_FA_AUTO_RE = re.compile(r"resolve_fused_ops: Flash Attention (enabled|not supported)")
_FA_RE = re.compile(r"llama_context: flash_attn\s+=\s+(\w+)")


@dataclass(frozen=True, kw_only=True)
class LoggedCache:
    """One cache as llama-server logs it (`llama_kv_cache: size = …`, `llama_memory_recurrent: size = …`)."""

    kind: str
    """`kv` (full attention), `kv_swa` (after `creating SWA KV cache`) or `recurrent`."""
    cells: int
    """Cells (tokens for K/V, sequences for recurrent state)."""
    layers: int
    """Layers it holds."""
    mib: float
    """Its size in MiB, two decimals."""
    type_k: str
    """K type (R for recurrent state)."""
    type_v: str
    """V type (S for recurrent state)."""


@dataclass(frozen=True, kw_only=True)
class ServerLogFacts:
    """What a llama-server log (`--log-verbosity 4`) says about its sizing; None where a line is missing."""

    n_slots: int | None = None
    """`initializing, n_slots = S`."""
    n_ctx_slot: int | None = None
    """`n_ctx_slot = C`: the context one slot may use."""
    kv_unified: str | None = None
    """`kv_unified = 'true'`."""
    n_ctx: int | None = None
    """`llama_context: n_ctx = A`: the aggregate context."""
    caches: tuple[LoggedCache, ...] = ()
    """Every cache, in the order logged."""
    kv_cells: int | None = None
    """Cells of the full-attention K/V cache (`llama_kv_cache: size = … (N cells, …)`)."""
    kv_mib: float | None = None
    """Size of the full-attention K/V cache in MiB (2 decimals, as logged)."""
    cache_type_k: str | None = None
    """`K (t)` of the full-attention cache (else of the first K/V cache)."""
    cache_type_v: str | None = None
    """`V (t)` of the full-attention cache (else of the first K/V cache)."""
    offloaded: tuple[int, int] | None = None
    """`offloaded L/N layers to GPU`; absent on a CPU build."""
    compute_mib: dict[str, float] = field(default_factory=dict)
    """`sched_reserve: <buffer> compute buffer size = X MiB`, per buffer (`CPU`, `CUDA0`, `CUDA_Host`)."""
    model_mib: dict[str, float] = field(default_factory=dict)
    """`load_tensors: <buffer> model buffer size = X MiB`, per buffer (summed over the files of a split model)."""
    flash_attn: str | None = None
    """`enabled` or `disabled`: what `auto` resolved to, or what was set."""
    overflow_warning: bool = False
    """`possible training context overflow` (llama_context)."""
    capping_warning: bool = False
    """`exceeds the training context of the model … capping` (llama-server)."""
    fit_failed: bool = False
    """`failed to fit params`."""


def _last(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    found = None
    for found in pattern.finditer(text):  # noqa: B007 - keep the last match
        pass
    return found


def _caches(text: str) -> tuple[LoggedCache, ...]:
    """The caches in log order; a K/V cache after `creating SWA KV cache` is the sliding-window one."""
    found: list[tuple[int, LoggedCache]] = []
    creating = [(m.start(), m[1]) for m in _SWA_CREATING.finditer(text)]
    for m in _KV_RE.finditer(text):
        before = [kind for at, kind in creating if at < m.start()]
        kind = "kv_swa" if before and before[-1] == "SWA" else "kv"
        cache = LoggedCache(kind=kind, cells=int(m[2]), layers=int(m[3]), mib=float(m[1]), type_k=m[4], type_v=m[6])
        found.append((m.start(), cache))
    for m in _RECURRENT_RE.finditer(text):
        cache = LoggedCache(
            kind="recurrent", cells=int(m[2]), layers=int(m[3]), mib=float(m[1]), type_k=m[4], type_v=m[6]
        )
        found.append((m.start(), cache))
    return tuple(cache for _, cache in sorted(found, key=lambda item: item[0]))


def _summed(matches: Iterator[re.Match[str]]) -> dict[str, float]:
    """Buffer sizes by name; a split model maps each file on its own line, so one name may repeat."""
    sizes: dict[str, float] = {}
    for m in matches:
        sizes[m[1]] = round(sizes.get(m[1], 0.0) + float(m[2]), 2)
    return sizes


def parse_server_log(text: str) -> ServerLogFacts:
    """Read the sizing facts of the last llama-server run in a log; the last match of each line wins.

    Args:
        text: the log; when it holds several runs (a relaunch appends), only the last run is read.

    Returns:
        The facts.
    """
    start = text.rfind(_RUN_START)
    if start > 0:
        text = text[start:]
    slots, n_ctx, offload = (_last(p, text) for p in (_SLOTS_RE, _N_CTX_RE, _OFFLOAD_RE))
    fa_auto, fa = _last(_FA_AUTO_RE, text), _last(_FA_RE, text)
    flash = None
    if fa_auto is not None:
        flash = "enabled" if fa_auto[1] == "enabled" else "disabled"
    elif fa is not None and fa[1] in ("enabled", "disabled"):
        flash = fa[1]
    caches = _caches(text)
    kv_caches = [c for c in caches if c.kind != "recurrent"]
    full = next((c for c in kv_caches if c.kind == "kv"), kv_caches[0] if kv_caches else None)
    return ServerLogFacts(
        n_slots=int(slots[1]) if slots else None,
        n_ctx_slot=int(slots[2]) if slots else None,
        kv_unified=slots[3] if slots else None,
        n_ctx=int(n_ctx[1]) if n_ctx else None,
        caches=caches,
        kv_cells=full.cells if full else None,
        kv_mib=full.mib if full else None,
        cache_type_k=full.type_k if full else None,
        cache_type_v=full.type_v if full else None,
        offloaded=(int(offload[1]), int(offload[2])) if offload else None,
        compute_mib={m[1]: float(m[2]) for m in _COMPUTE_RE.finditer(text)},
        model_mib=_summed(_MODEL_RE.finditer(text)),
        flash_attn=flash,
        overflow_warning="possible training context overflow" in text,
        capping_warning="exceeds the training context of the model" in text,
        fit_failed="failed to fit params" in text,
    )


def _check(name: str, source: str, expected: object, actual: object) -> None:
    if actual != expected:
        raise VerificationError(
            f"The running llama-server differs from its plan: {name} ({source}) is {actual!r}, the plan says "
            f"{expected!r}. Stop it and relaunch from the plan.",
            field=name,
            expected=expected,
            actual=actual,
        )


def _dig(data: Any, *path: str | int) -> Any:
    for key in path:
        try:
            data = data[key]
        except (KeyError, IndexError, TypeError):
            return None
    return data


async def _get_json(session: aiohttp.ClientSession, endpoint: str, path: str) -> Any:
    try:
        async with session.get(endpoint + path, allow_redirects=False) as response:
            if response.status != 200:
                raise VerificationError(
                    f"llama-server answered {path} with HTTP {response.status}; a planned server serves it with 200.",
                    field=path,
                    expected=200,
                    actual=response.status,
                )
            return await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise VerificationError(
            f"llama-server at {endpoint} did not answer {path} ({type(exc).__name__}: {exc}).",
            field=path,
            expected="a JSON answer",
            actual=str(exc),
        ) from exc


def check_log(plan: Plan, facts: ServerLogFacts) -> list[str]:
    """Compare the log's facts with the plan.

    The facts every llama-server logs are checked for every model: slots, the per-slot context, the unified
    pool, the aggregate context, the K/V cache types, flash attention, layer offload, the training-context
    warnings and fit failures. Each planned cache (full K/V, sliding-window K/V, recurrent state) is then matched
    with the logged cache of its kind, by cells and layers. For an architecture whose caches are not modelled
    those matches cannot be made; they are returned as unverified instead of failing a correct server.

    Args:
        plan: the plan.
        facts: `parse_server_log` of the server's log.

    Returns:
        The checks that could not be made, each `"<check>: <why>"`.

    Raises:
        VerificationError: a value differs or a required line is missing.
    """
    if facts.fit_failed:
        raise VerificationError(
            "llama-server logged 'failed to fit params'; its sizing is not the plan's.",
            field="fit",
            expected="no fit failure",
            actual="failed to fit params",
        )
    log = "server log"
    _check("slots", f"{log}: initializing, n_slots", plan.slots, facts.n_slots)
    _check("slot_context_limit", f"{log}: n_ctx_slot", plan.slot_context_limit, facts.n_ctx_slot)
    _check("kv_unified", f"{log}: kv_unified", "true", facts.kv_unified)
    _check("aggregate_context", f"{log}: llama_context: n_ctx", plan.aggregate_context, facts.n_ctx)
    for cache in facts.caches:
        if cache.kind == "recurrent":
            continue
        where = "sliding-window " if cache.kind == "kv_swa" else ""
        _check("cache_type_k", f"{log}: {where}llama_kv_cache K type", plan.cache_type_k, cache.type_k)
        _check("cache_type_v", f"{log}: {where}llama_kv_cache V type", plan.cache_type_v, cache.type_v)
    if plan.flash_attn == "on":
        _check("flash_attn", f"{log}: flash attention", "enabled", facts.flash_attn)
    if plan.cpu_mode:
        # A CPU build logs no offload; a GPU build on a host without GPUs must offload nothing.
        if facts.offloaded is not None:
            _check("gpu_layers", f"{log}: offloaded layers", 0, facts.offloaded[0])
    else:
        expected = (plan.gpu_layers, plan.total_layers)
        _check("gpu_layers", f"{log}: offloaded L/L layers to GPU", expected, facts.offloaded)
    overflow = plan.aggregate_context > plan.train_context
    _check("training_context_overflow", f"{log}: overflow warning", overflow, facts.overflow_warning)
    _check("training_context_capping", f"{log}: capping warning", overflow, facts.capping_warning)
    if not plan.memory_known:
        seen = ", ".join(f"{c.kind} {c.cells} cells × {c.layers} layers" for c in facts.caches) or "no cache"
        return [
            f"caches: llama.cpp's caches for architecture {plan.architecture!r} are not modelled, so their cells "
            f"and layers were not compared with a plan (the server logged {seen})"
        ]
    _check("caches", f"{log}: cache kinds", [c.kind for c in plan.caches], [c.kind for c in facts.caches])
    for planned, logged in zip(plan.caches, facts.caches, strict=True):
        name = {"kv": "kv_cells", "kv_swa": "swa_kv_cells", "recurrent": "recurrent_cells"}[planned.kind]
        source = f"{log}: {_CACHE_LINES[planned.kind]}"
        _check(name, f"{source} cells", planned.cells, logged.cells)
        # llama_memory_recurrent logs the model's block count (`hparams.n_layer()`), not the blocks it holds.
        layers = plan.total_layers - 1 if planned.kind == "recurrent" else len(planned.layers)
        _check(name.replace("cells", "layers"), f"{source} layers", layers, logged.layers)
    return []


_CACHE_LINES = {
    "kv": "llama_kv_cache",
    "kv_swa": "sliding-window llama_kv_cache",
    "recurrent": "llama_memory_recurrent",
}
"""The log line each cache kind is read from."""


_LOADED = ": model loaded"
"""What llama-server logs once the model and its slots are set up, after the lines `check_log` reads."""


async def _read_loaded_log(log_path: Path, timeout_s: float) -> str:
    """The log once its last run has logged `model loaded`, or as it stands at the deadline.

    llama.cpp's `common_log` writes from a worker thread, so `/health` can answer before the lines of the load
    reach the file; the log is read again, with a growing pause, until the last run says it has loaded.
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    pause_s = 0.01
    while True:
        try:
            text = await asyncio.to_thread(log_path.read_text, encoding="utf-8", errors="replace")
        except OSError as exc:
            raise VerificationError(
                f"The llama-server log {log_path} cannot be read: {exc}.",
                field="log",
                expected=str(log_path),
                actual=None,
            ) from exc
        if _LOADED in text[max(text.rfind(_RUN_START), 0) :] or asyncio.get_running_loop().time() >= deadline:
            return text
        await asyncio.sleep(pause_s)
        pause_s = min(pause_s * 2, 0.2)


async def verify_runtime(
    plan: Plan,
    *,
    endpoint: str,
    log_path: Path,
    alias: str,
    devices_after: Sequence[DeviceMemory],
    timeout_s: float = 10.0,
) -> LlamaCppRuntime:
    """Verify a running llama-server against its plan and return the node's `llamacpp_runtime` record.

    Args:
        plan: the plan it was launched from.
        endpoint: its base URL on loopback or the node's network, `http://host:port`.
        log_path: its log file (stdout and stderr at `--log-verbosity 4`).
        alias: the `--alias` it was launched with.
        devices_after: the devices read after the model loaded (`read_devices`), in plan order.
        timeout_s: the deadline for each HTTP request, in seconds.

    Returns:
        The record: `requested` (the policy), `effective` (the plan's values, which the server has just
        confirmed), `gpus` (memory after load, the CPU device in CPU mode) and `observed_at` (UTC).

    Raises:
        VerificationError: any value differs (the message names it, expected and actual), an endpoint does not
            answer, a log line is missing, or a device has less than the fit target free after the load.
    """
    endpoint = endpoint.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(trust_env=False, timeout=timeout) as session:
        health = await _get_json(session, endpoint, "/health")
        _check("health", "/health status", "ok", _dig(health, "status"))
        props = await _get_json(session, endpoint, "/props")
        slots = await _get_json(session, endpoint, "/slots")
        models = await _get_json(session, endpoint, "/v1/models")
    _check("slots", "/props total_slots", plan.slots, _dig(props, "total_slots"))
    _check(
        "slot_context_limit",
        "/props default_generation_settings.n_ctx",
        plan.slot_context_limit,
        _dig(props, "default_generation_settings", "n_ctx"),
    )
    _check("alias", "/props model_alias", alias, _dig(props, "model_alias"))
    _check("slots", "/slots count", plan.slots, len(slots) if isinstance(slots, list) else None)
    for i, slot in enumerate(slots):
        _check("slot_context_limit", f"/slots[{i}].n_ctx", plan.slot_context_limit, _dig(slot, "n_ctx"))
    _check(
        "train_context",
        "/v1/models data[0].meta.n_ctx_train",
        plan.train_context,
        _dig(models, "data", 0, "meta", "n_ctx_train"),
    )
    text = await _read_loaded_log(log_path, timeout_s)
    unverified = check_log(plan, parse_server_log(text))
    _check("devices", "device count after load", len(plan.devices), len(devices_after))
    target = plan.policy.fit_target_mib
    for device in devices_after:
        if device.free_mib < target:
            raise VerificationError(
                f"Device {device.index} ({device.name}) has {device.free_mib} MiB free after the load, below the fit "
                f"target of {target} MiB; the estimate was too low. Stop the server and plan with a larger target.",
                field="free_mib",
                expected=f">= {target}",
                actual=device.free_mib,
            )
    for item in unverified:
        logger.warning("llama-server for %r verified without one check: %s", alias, item)
    return LlamaCppRuntime(
        requested=plan.requested(),
        effective=plan.effective(),
        gpus=[d.record() for d in devices_after],
        observed_at=datetime.now(UTC),
        architecture=plan.architecture,
        memory=[c.record() for c in plan.caches],
        unverified=unverified,
    )
