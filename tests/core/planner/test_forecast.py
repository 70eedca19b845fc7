"""Forecasts of other sizings from a running server's runtime record: cache scaling, free memory, the auto pick."""

from __future__ import annotations

import pytest

from qiip_core.planner import CONTEXT_FLOOR, RecordedServer, auto_search
from tests.core.planner.conftest import cpu, gpu

EFFECTIVE = {"train_context": 8192, "slots": 2, "context_per_slot": 2048, "aggregate_context": 4096}
KV = [{"kind": "kv", "cells": 4096, "layers": 32, "type_k": "f16", "type_v": "f16", "mib": 512.0}]


def test_the_kv_cache_scales_with_cells_and_element_size():
    server = RecordedServer.from_record(EFFECTIVE, KV, [cpu(10_000, 32_000)])
    assert server is not None
    assert server.kv_mib(2048, 2, "f16") == pytest.approx(512)
    assert server.kv_mib(4096, 2, "f16") == pytest.approx(1024)
    assert server.kv_mib(2048, 2, "q8_0") == pytest.approx(512 * 34 / 64)
    # The aggregate is rounded up to 256 cells, as llama.cpp's --ctx-size is.
    assert server.kv_mib(300, 1, "f16") == pytest.approx(512 * 512 / 4096)


def test_free_memory_after_a_sizing_and_whether_it_fits():
    server = RecordedServer.from_record(EFFECTIVE, KV, [gpu(0, 1000), gpu(1, 2000)])
    assert server is not None
    bigger = server.forecast(4096, 2, "f16", fit_target_mib=512)
    # 512 MiB more cache, spread evenly over the two GPUs.
    assert bigger.free_after_mib == pytest.approx((744, 1744))
    assert bigger.aggregate_context == 8192 and bigger.fits
    too_big = server.forecast(8192, 2, "f16", fit_target_mib=512)
    assert too_big.free_after_mib[0] < 512 + 4 and not too_big.fits


def test_sliding_window_and_recurrent_caches_grow_with_the_slots():
    memory = [
        {"kind": "kv", "cells": 4096, "type_k": "f16", "mib": 100.0},
        {"kind": "kv_swa", "cells": 2048, "type_k": "f16", "mib": 200.0},
        {"kind": "recurrent", "cells": 2, "type_k": "f32", "mib": 10.0},
    ]
    server = RecordedServer.from_record(EFFECTIVE, memory, [cpu(10_000, 32_000)])
    assert server is not None
    assert server.kv_mib(1024, 4, "f16") == pytest.approx(100 + 400 + 20)
    # The window's cells never exceed the aggregate.
    assert server.kv_mib(256, 4, "f16") == pytest.approx(100 / 4 + 200 / 2 + 20)


def test_the_automatic_pick_is_the_planners_search_on_the_forecast():
    server = RecordedServer.from_record(EFFECTIVE, KV, [cpu(2_000, 32_000)])
    assert server is not None
    pick = server.automatic(fit_target_mib=512)
    assert pick is not None and pick.fits and pick.cache_type == "f16"
    # The training context fits at one slot, then the most slots that still fit.
    assert pick.context_per_slot == 8192
    assert not server.forecast(8192, pick.slots + 1, "f16", fit_target_mib=512).fits
    # With almost nothing free, F16 cannot hold the floor and Q8_0 is tried; with nothing, no pick.
    tight = RecordedServer.from_record(EFFECTIVE, KV, [cpu(0, 32_000)])
    assert tight is not None
    assert not tight.forecast(CONTEXT_FLOOR, 1, "f16", fit_target_mib=0).fits
    q8 = tight.automatic(fit_target_mib=0)
    assert q8 is not None and q8.cache_type == "q8_0" and q8.context_per_slot >= CONTEXT_FLOOR and q8.fits
    none = RecordedServer.from_record(EFFECTIVE, KV, [cpu(0, 32_000)])
    assert none is not None and none.automatic(fit_target_mib=10_000) is None


def test_records_without_caches_cannot_be_forecast():
    assert RecordedServer.from_record(EFFECTIVE, [], [cpu(1000)]) is None
    assert RecordedServer.from_record(EFFECTIVE, KV, []) is None
    assert RecordedServer.from_record({"slots": 2}, KV, [cpu(1000)]) is None


def test_auto_search_alone():
    assert auto_search(8192, lambda context, slots, _: context * slots <= 16384, "f16") == (8192, 2)
    assert auto_search(8192, lambda *_: False, "f16") is None
