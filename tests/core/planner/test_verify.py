"""Verification against a stand-in llama-server on loopback, and log parsing on recorded lines."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC
from typing import Any

import pytest
from aiohttp import web

from qiip_core import VerificationError
from qiip_core.planner import CustomPolicy, Plan, PythonEstimator, parse_server_log, plan, verify_runtime
from qiip_core.planner._verify import check_log

from .conftest import cpu, gpu, shape

CPU_LOG = """\
0.00.008.629 I load_tensors:   CPU_Mapped model buffer size =     9.46 MiB
0.00.008.882 I llama_context: n_ctx                 = 16384
0.00.008.882 I llama_context: n_ctx_seq             = 16384
0.00.008.883 I llama_context: flash_attn            = auto
0.00.008.886 W llama_context: n_ctx_seq (16384) > n_ctx_train (8192) -- possible training context overflow
0.00.024.599 I llama_kv_cache: size =   32.00 MiB ( 16384 cells,   4 layers,  2/1 seqs), K (f16):   16.00 MiB, \
V (f16):   16.00 MiB
0.00.025.239 I resolve_fused_ops: Flash Attention enabled
0.00.025.848 I sched_reserve:        CPU compute buffer size =    24.01 MiB
0.00.031.599 W srv    load_model: the slot context (16384) exceeds the training context of the model (8192) - capping
0.00.038.588 I srv    load_model: initializing, n_slots = 2, n_ctx_slot = 8192, kv_unified = 'true'
0.00.039.101 I srv  llama_server: model loaded
"""

GPU_LOG = """\
load_tensors: offloading 4 repeating layers to GPU
load_tensors: offloaded 5/5 layers to GPU
load_tensors:        CUDA0 model buffer size =  4000.00 MiB
load_tensors:   CPU_Mapped model buffer size =   250.00 MiB
llama_context: n_ctx                 = 16384
llama_context: flash_attn            = enabled
llama_context: n_ctx_seq (16384) > n_ctx_train (8192) -- possible training context overflow
llama_kv_cache:      CUDA0 KV buffer size =  1088.00 MiB
llama_kv_cache: size = 1088.00 MiB ( 16384 cells,   4 layers,  2/1 seqs), K (q8_0):  544.00 MiB, V (q8_0):  544.00 MiB
sched_reserve:      CUDA0 compute buffer size =   300.01 MiB
sched_reserve:  CUDA_Host compute buffer size =    24.02 MiB
srv    load_model: the slot context (16384) exceeds the training context of the model (8192) - capping
srv    load_model: initializing, n_slots = 2, n_ctx_slot = 8192, kv_unified = 'true'
"""


def make_plan(devices=None, *, train: int = 8192, context: int = 8192, slots: int = 2, cache: str = "f16") -> Plan:
    policy = CustomPolicy(fit_target_mib=512, context_per_slot=context, slots=slots, cache_type=cache)
    devices = devices or [cpu(4000, total_mib=4096)]
    return plan(shape(n_ctx_train=train), devices, policy, estimator=PythonEstimator())


def test_parse_a_cpu_log():
    facts = parse_server_log(CPU_LOG)
    assert (facts.n_slots, facts.n_ctx_slot, facts.kv_unified, facts.n_ctx) == (2, 8192, "true", 16384)
    assert (facts.kv_cells, facts.kv_mib, facts.cache_type_k, facts.cache_type_v) == (16384, 32.0, "f16", "f16")
    assert facts.compute_mib == {"CPU": 24.01} and facts.model_mib == {"CPU_Mapped": 9.46}
    assert facts.offloaded is None and facts.flash_attn == "enabled"
    assert facts.overflow_warning and facts.capping_warning and not facts.fit_failed


def test_parse_a_gpu_log():
    facts = parse_server_log(GPU_LOG)
    assert facts.offloaded == (5, 5) and facts.cache_type_k == "q8_0" and facts.flash_attn == "enabled"
    assert facts.compute_mib == {"CUDA0": 300.01, "CUDA_Host": 24.02}
    assert facts.model_mib == {"CUDA0": 4000.0, "CPU_Mapped": 250.0}


def test_the_last_match_counts_and_missing_lines_are_none():
    facts = parse_server_log(CPU_LOG + "llama_context: n_ctx                 = 4096\n")
    assert facts.n_ctx == 4096
    empty = parse_server_log("")
    assert empty.n_slots is None and empty.cache_type_k is None and empty.flash_attn is None


def cpu_plan() -> Plan:
    p = make_plan()
    assert (p.slots, p.aggregate_context, p.cache_type_k) == (2, 16384, "f16")  # what CPU_LOG shows
    return p


def test_a_matching_log_passes():
    assert check_log(cpu_plan(), parse_server_log(CPU_LOG)) == []


# Gemma 3 270M at 2 slots × 8192 tokens: llama_kv_cache_iswa, a full cache for 3 layers and a sliding-window cache
# of pad256(512 × 2 + 512) = 1536 cells for 15 (lines as the real server logs them).
GEMMA_LOG = """0.00.002.134 I srv  llama_server: initializing ...
0.00.450.235 I llama_context: n_ctx                 = 16384
0.00.451.044 I llama_kv_cache_iswa: creating non-SWA KV cache, size = 16384 cells
0.00.472.541 I llama_kv_cache: size =   48.00 MiB ( 16384 cells,   3 layers,  2/1 seqs), K (f16):   24.00 MiB, \
V (f16):   24.00 MiB
0.00.472.566 I llama_kv_cache_iswa: creating     SWA KV cache, size = 1536 cells
0.00.481.978 I llama_kv_cache: size =   22.50 MiB (  1536 cells,  15 layers,  2/1 seqs), K (f16):   11.25 MiB, \
V (f16):   11.25 MiB
0.00.482.632 I resolve_fused_ops: Flash Attention enabled
0.00.483.993 I sched_reserve:        CPU compute buffer size =    35.27 MiB
0.00.524.481 I srv    load_model: initializing, n_slots = 2, n_ctx_slot = 16384, kv_unified = 'true'
"""


def gemma_plan() -> Plan:
    layers = tuple(il % 6 < 5 for il in range(18))
    s = replace(
        shape(n_layers=18, n_embd=640, n_head=4, n_head_kv=1, head_dim=256, n_ctx_train=32768, n_vocab=4096),
        architecture="gemma3",
        memory="iswa",
        swa_window=512,
        swa_layers=layers,
        n_ff=2048,
    )
    policy = CustomPolicy(fit_target_mib=512, context_per_slot=8192, slots=2, cache_type="f16")
    return plan(s, [cpu(8000, total_mib=8192)], policy, estimator=PythonEstimator())


def test_a_sliding_window_model_checks_both_caches():
    facts = parse_server_log(GEMMA_LOG)
    assert [(c.kind, c.cells, c.layers, c.mib) for c in facts.caches] == [
        ("kv", 16384, 3, 48.0),
        ("kv_swa", 1536, 15, 22.5),
    ]
    p = gemma_plan()
    assert [(c.kind, c.cells, len(c.layers)) for c in p.caches] == [("kv", 16384, 3), ("kv_swa", 1536, 15)]
    assert check_log(p, facts) == []
    with pytest.raises(VerificationError) as caught:
        check_log(p, parse_server_log(GEMMA_LOG.replace("1536 cells", "2048 cells")))
    assert (caught.value.field, caught.value.expected, caught.value.actual) == ("swa_kv_cells", 1536, 2048)
    with pytest.raises(VerificationError) as caught:
        check_log(p, parse_server_log(GEMMA_LOG.replace("V (f16):   11.25", "V (q8_0):   11.25")))
    assert caught.value.field == "cache_type_v" and "sliding-window" in str(caught.value)


def test_a_missing_cache_is_a_difference():
    only_full = "\n".join(line for line in GEMMA_LOG.splitlines() if "15 layers" not in line)
    with pytest.raises(VerificationError) as caught:
        check_log(gemma_plan(), parse_server_log(only_full))
    assert (caught.value.field, caught.value.expected, caught.value.actual) == ("caches", ["kv", "kv_swa"], ["kv"])


def test_an_architecture_without_memory_rules_is_verified_on_what_every_server_logs():
    # What plan() makes of an architecture it has no memory rules for (planned by llama-fit-params).
    p = replace(gemma_plan(), architecture="someday-arch", memory_known=False, caches=())
    (unverified,) = check_log(p, parse_server_log(GEMMA_LOG))
    assert unverified.startswith("caches: llama.cpp's caches for architecture 'someday-arch' are not modelled")
    assert "kv 16384 cells × 3 layers, kv_swa 1536 cells × 15 layers" in unverified
    # The universal checks still apply.
    with pytest.raises(VerificationError, match="slots"):
        check_log(p, parse_server_log(GEMMA_LOG.replace("n_slots = 2", "n_slots = 4")))
    with pytest.raises(VerificationError, match="cache_type_k"):
        check_log(p, parse_server_log(GEMMA_LOG.replace("K (f16)", "K (q4_0)")))


def test_only_the_last_run_of_an_appended_log_counts():
    earlier = GEMMA_LOG.replace("16384", "32768")
    facts = parse_server_log(earlier + "qiip_fit_plan: sizing=custom …\n" + GEMMA_LOG)
    assert [c.cells for c in facts.caches] == [16384, 1536] and facts.n_ctx == 16384


def test_recurrent_state_is_read():
    line = (
        "llama_memory_recurrent: size =    0.19 MiB (     3 cells,   4 layers,  3 seqs  0 rs_seq), "
        "R (f32):    0.19 MiB, S (f32):    0.00 MiB, P (f32):    0.00 MiB\n"
    )
    (cache,) = parse_server_log(line).caches
    assert (cache.kind, cache.cells, cache.layers, cache.mib, cache.type_k, cache.type_v) == (
        "recurrent",
        3,
        4,
        0.19,
        "f32",
        "f32",
    )


@pytest.mark.parametrize(
    ("old", "new", "field", "expected", "actual"),
    [
        ("n_slots = 2", "n_slots = 3", "slots", 2, 3),
        ("n_ctx_slot = 8192", "n_ctx_slot = 4096", "slot_context_limit", 8192, 4096),
        ("kv_unified = 'true'", "kv_unified = 'false'", "kv_unified", "true", "false"),
        ("n_ctx                 = 16384", "n_ctx                 = 8192", "aggregate_context", 16384, 8192),
        ("16384 cells", "8192 cells", "kv_cells", 16384, 8192),
        ("4 layers", "3 layers", "kv_layers", 4, 3),
        ("K (f16)", "K (q8_0)", "cache_type_k", "f16", "q8_0"),
        ("V (f16)", "V (q4_0)", "cache_type_v", "f16", "q4_0"),
        ("initializing, n_slots", "starting, n_slots", "slots", 2, None),
    ],
)
def test_every_log_difference_names_its_value(old, new, field, expected, actual):
    with pytest.raises(VerificationError) as caught:
        check_log(cpu_plan(), parse_server_log(CPU_LOG.replace(old, new)))
    error = caught.value
    assert (error.field, error.expected, error.actual) == (field, expected, actual)
    assert f"is {actual!r}, the plan says {expected!r}" in str(error)


def test_a_fit_failure_is_fatal():
    with pytest.raises(VerificationError, match="failed to fit params") as caught:
        check_log(cpu_plan(), parse_server_log(CPU_LOG + "common_fit_params: failed to fit params\n"))
    assert caught.value.field == "fit"


def test_the_overflow_warnings_appear_exactly_when_the_pool_exceeds_the_training_context():
    # 2 slots of 8192 in a model trained on 8192: one slot alone could run past 8192, so llama.cpp warns
    # and llama-server caps each slot at the training context.
    for line, field in [
        ("possible training context overflow", "training_context_overflow"),
        ("capping", "training_context_capping"),
    ]:
        without = "\n".join(x for x in CPU_LOG.splitlines() if line not in x)
        with pytest.raises(VerificationError) as caught:
            check_log(cpu_plan(), parse_server_log(without))
        assert (caught.value.field, caught.value.expected, caught.value.actual) == (field, True, False)
    # A pool within the training context: no warning may appear.
    p = make_plan(train=16384)
    assert p.aggregate_context == p.train_context == 16384 and p.slot_context_limit == 16384
    log = CPU_LOG.replace("n_ctx_slot = 8192", "n_ctx_slot = 16384")
    with pytest.raises(VerificationError) as caught:
        check_log(p, parse_server_log(log))
    assert (caught.value.field, caught.value.expected, caught.value.actual) == (
        "training_context_overflow",
        False,
        True,
    )
    quiet = "\n".join(x for x in log.splitlines() if "overflow" not in x and "capping" not in x)
    check_log(p, parse_server_log(quiet))


def test_gpu_plans_check_the_offload_and_flash_attention():
    p = make_plan([gpu(0, 4000, total_mib=4096)], cache="q8_0")
    check_log(p, parse_server_log(GPU_LOG))
    with pytest.raises(VerificationError) as caught:
        check_log(p, parse_server_log(GPU_LOG.replace("offloaded 5/5", "offloaded 3/5")))
    assert (caught.value.field, caught.value.expected, caught.value.actual) == ("gpu_layers", (5, 5), (3, 5))
    with pytest.raises(VerificationError) as caught:
        check_log(p, parse_server_log(GPU_LOG.replace("= enabled", "= disabled")))
    assert caught.value.field == "flash_attn"
    # In CPU mode an offload line, if a build prints one, must offload nothing.
    with pytest.raises(VerificationError) as caught:
        check_log(cpu_plan(), parse_server_log(CPU_LOG + "load_tensors: offloaded 2/5 layers to GPU\n"))
    assert caught.value.field == "gpu_layers"


# --- verify_runtime against a stand-in server --------------------------------------------------------------


def answers(p: Plan, alias: str = "m") -> dict[str, Any]:
    return {
        "/health": {"status": "ok"},
        "/props": {
            "total_slots": p.slots,
            "model_alias": alias,
            "default_generation_settings": {"n_ctx": p.slot_context_limit},
        },
        "/slots": [{"id": i, "n_ctx": p.slot_context_limit} for i in range(p.slots)],
        "/v1/models": {"data": [{"id": alias, "meta": {"n_ctx_train": p.train_context}}]},
    }


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, dict[str, Any]]]:
    routes: dict[str, Any] = {}

    async def handle(request: web.Request) -> web.StreamResponse:
        body = routes.get(request.path)
        if body is None:
            return web.Response(status=404)
        if isinstance(body, int):
            return web.Response(status=body)
        return web.json_response(body)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", routes
    finally:
        await runner.cleanup()


async def test_a_server_that_runs_its_plan_gets_its_record(server, tmp_path):
    endpoint, routes = server
    p = cpu_plan()
    routes.update(answers(p))
    log = tmp_path / "server.log"
    log.write_text(CPU_LOG)
    after = [cpu(3000, total_mib=4096)]
    record = await verify_runtime(p, endpoint=endpoint + "/", log_path=log, alias="m", devices_after=after)
    assert record.requested == {
        "sizing": "custom",
        "fit_target_mib": 512,
        "context_per_slot": 8192,
        "slots": 2,
        "cache_type": "f16",
        "allow_estimator_overrun": False,
    }
    assert record.effective == p.effective()
    assert record.gpus == [{"index": 0, "total_mib": 4096, "used_mib": 1096, "free_mib": 3000}]
    assert record.observed_at.tzinfo is UTC


@pytest.mark.parametrize(
    ("path", "change", "field", "expected", "actual"),
    [
        ("/props", {"total_slots": 3}, "slots", 2, 3),
        ("/props", {"model_alias": "other"}, "alias", "m", "other"),
        ("/props", {"default_generation_settings": {"n_ctx": 4096}}, "slot_context_limit", 8192, 4096),
        ("/props", {"default_generation_settings": {}}, "slot_context_limit", 8192, None),
        ("/slots", [{"n_ctx": 8192}], "slots", 2, 1),
        ("/slots", [{"n_ctx": 8192}, {"n_ctx": 2048}], "slot_context_limit", 8192, 2048),
        ("/v1/models", {"data": [{"meta": {"n_ctx_train": 4096}}]}, "train_context", 8192, 4096),
        ("/v1/models", {"data": []}, "train_context", 8192, None),
        ("/health", {"status": "loading"}, "health", "ok", "loading"),
        ("/props", 503, "/props", 200, 503),
    ],
)
async def test_every_endpoint_difference_names_its_value(server, tmp_path, path, change, field, expected, actual):
    endpoint, routes = server
    p = cpu_plan()
    routes.update(answers(p))
    if isinstance(change, dict) and isinstance(routes[path], dict):
        routes[path] = copy.deepcopy(routes[path]) | change
    else:
        routes[path] = change
    log = tmp_path / "server.log"
    log.write_text(CPU_LOG)
    with pytest.raises(VerificationError) as caught:
        await verify_runtime(p, endpoint=endpoint, log_path=log, alias="m", devices_after=[cpu(3000, 4096)])
    assert (caught.value.field, caught.value.expected, caught.value.actual) == (field, expected, actual)


async def test_missing_log_low_free_memory_and_no_server(server, tmp_path):
    endpoint, routes = server
    p = cpu_plan()
    routes.update(answers(p))
    with pytest.raises(VerificationError, match="cannot be read") as caught:
        await verify_runtime(
            p, endpoint=endpoint, log_path=tmp_path / "none.log", alias="m", devices_after=[cpu(3000, 4096)]
        )
    assert caught.value.field == "log"
    log = tmp_path / "server.log"
    log.write_text(CPU_LOG)
    with pytest.raises(VerificationError, match="below the fit target of 512 MiB") as caught:
        await verify_runtime(p, endpoint=endpoint, log_path=log, alias="m", devices_after=[cpu(100, 4096)])
    assert (caught.value.field, caught.value.actual) == ("free_mib", 100)
    with pytest.raises(VerificationError) as caught:
        await verify_runtime(p, endpoint=endpoint, log_path=log, alias="m", devices_after=[])
    assert caught.value.field == "devices"
    with pytest.raises(VerificationError, match="did not answer /health") as caught:
        await verify_runtime(
            p, endpoint="http://127.0.0.1:9", log_path=log, alias="m", devices_after=[cpu(3000, 4096)], timeout_s=2
        )
    assert caught.value.field == "/health"


async def test_the_log_lines_written_after_health_answers_are_waited_for(server, tmp_path):
    """llama.cpp logs from a worker thread: `/health` can say ok before the load's last lines reach the file."""
    endpoint, routes = server
    p = cpu_plan()
    routes.update(answers(p))
    loop = asyncio.get_running_loop()
    read_once = asyncio.Event()

    class WatchedLog(type(tmp_path)):  # type: ignore[misc]
        def read_text(self, *args: Any, **kwargs: Any) -> str:
            text: str = super().read_text(*args, **kwargs)
            loop.call_soon_threadsafe(read_once.set)
            return text

    log = WatchedLog(tmp_path / "server.log")
    head, tail = CPU_LOG.split("0.00.038.588")
    log.write_text(head)
    task = asyncio.create_task(
        verify_runtime(p, endpoint=endpoint, log_path=log, alias="m", devices_after=[cpu(3000, 4096)])
    )
    await read_once.wait()  # the check has read a log whose run has not said `model loaded`
    with log.open("a") as f:
        f.write("0.00.038.588" + tail)
    record = await task
    assert record.effective == p.effective()


def test_a_split_model_maps_each_file_on_its_own_line():
    lines = "".join(
        f"load_tensors:   CPU_Mapped model buffer size =     {mib} MiB\n" for mib in ("0.61", "0.47", "0.90")
    )
    assert parse_server_log(lines + "load_tensors:   CPU_REPACK model buffer size =     0.25 MiB\n").model_mib == {
        "CPU_Mapped": 1.98,
        "CPU_REPACK": 0.25,
    }
