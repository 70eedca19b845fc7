"""The console's pure parts: the fleet model, connection problems, chat history, the sizing form."""

from __future__ import annotations

import pytest

from qiip_core.client import ApiError, DaemonUnreachable, NodeEvent, Unauthorized
from qiip_tui._chat import Conversation, TurnState
from qiip_tui._connection import describe_problem, retry_delay_s
from qiip_tui._fleet import Fleet, FleetDelta, devices_of, gpu_totals, matches, training_context
from qiip_tui._sizing import SizingValues, check_sizing, sizing_preview
from tests.tui.samples import node, runtime, sample_fleet


def test_a_snapshot_then_events_report_only_what_changed() -> None:
    fleet = Fleet()
    first = fleet.load(sample_fleet())
    assert first.changed == {n.id for n in sample_fleet()} and not first.removed
    assert not fleet.load(sample_fleet()), "the same snapshot changes nothing"

    gpu01 = fleet.nodes["gpu01"]
    assert not fleet.apply(NodeEvent(change="added", node=gpu01)), "a repeated `added` changes nothing"
    drained = gpu01.model_copy(update={"status": "draining"})
    assert fleet.apply(NodeEvent(change="updated", node=drained)) == FleetDelta(changed=frozenset({"gpu01"}))
    assert fleet.apply(NodeEvent(change="removed", node=drained)) == FleetDelta(removed=frozenset({"gpu01"}))
    assert not fleet.apply(NodeEvent(change="removed", node=drained))

    smaller = fleet.load([n for n in sample_fleet() if n.id != "vllm02"])
    assert "vllm02" in smaller.removed and "gpu01" in smaller.changed


def test_deltas_merge_in_order() -> None:
    a = FleetDelta(changed=frozenset({"x"}))
    assert a.merge(FleetDelta(removed=frozenset({"x"}))) == FleetDelta(removed=frozenset({"x"}))
    assert FleetDelta(removed=frozenset({"x"})).merge(a) == FleetDelta(changed=frozenset({"x"}))


def test_the_request_rate_comes_from_two_polls_and_restarts_after_a_counter_reset() -> None:
    fleet = Fleet()
    fleet.load(sample_fleet())
    metrics = {"by_model": {"m": {"requests": 100}}, "by_node": {"gpu01": {"requests": 100, "ttft_p50_s": 0.25}}}
    assert fleet.apply_metrics(metrics, at_s=10.0) == FleetDelta(changed=frozenset({"gpu01"}))
    assert fleet.requests_per_s is None and fleet.ttft_p50_s == {"gpu01": 0.25}
    fleet.apply_metrics({**metrics, "by_model": {"m": {"requests": 130}}}, at_s=13.0)
    assert fleet.requests_per_s == pytest.approx(10.0)
    fleet.apply_metrics({"by_model": {"m": {"requests": 5}}, "by_node": {}}, at_s=16.0)
    assert fleet.requests_per_s is None and fleet.ttft_p50_s == {}, "a restarted daemon starts over"


def test_node_and_model_rates_between_two_polls() -> None:
    fleet = Fleet()
    fleet.load(sample_fleet())
    before = {
        "by_model": {"m": {"requests": 100, "errors": 0}},
        "by_node": {"gpu01": {"requests": 100, "failures": 0, "attempts": 100, "retries": 0, "completion_tokens": 0}},
    }
    after = {
        "by_model": {"m": {"requests": 150, "errors": 5}},
        "by_node": {
            "gpu01": {
                "requests": 145,
                "failures": 5,
                "attempts": 150,
                "retries": 5,
                "completion_tokens": 1000,
                "ttft_p50_s": 0.2,
                "ttft_p95_s": 0.9,
            }
        },
    }
    fleet.apply_metrics(before, at_s=0.0)
    # Every node changed: gpu01 has rates, and the nodes the daemon has no counts of are idle, not unknown.
    assert fleet.apply_metrics(after, at_s=10.0) == FleetDelta(changed=frozenset(fleet.nodes))
    assert fleet.rates.nodes["gpu02"].requests_per_s == 0 and fleet.rates.nodes["gpu02"].error_ratio is None
    rates = fleet.rates.nodes["gpu01"]
    assert rates.requests_per_s == pytest.approx(4.5) and rates.error_ratio == pytest.approx(0.1)
    assert rates.retries_per_s == pytest.approx(0.5) and rates.tokens_per_s == pytest.approx(100.0)
    assert (rates.ttft_p50_s, rates.ttft_p95_s) == (0.2, 0.9)
    assert fleet.rates.models["m"].error_ratio == pytest.approx(0.1)
    assert list(fleet.rates.history["gpu01"]) == [rates]
    assert fleet.is_problem(fleet.nodes["gpu01"]), "a healthy node failing requests needs attention"
    # A model whose last healthy node fails comes first, however it is named.
    fleet.update(fleet.nodes["vllm01"].model_copy(update={"status": "unhealthy"}))
    first = fleet.model_summaries()[0]
    assert (first.model, first.healthy, first.nodes) == ("meta/Llama-3.1-70B", 0, 3)


def test_status_counts_follow_the_status_order() -> None:
    fleet = Fleet()
    fleet.load(sample_fleet())
    assert fleet.status_counts() == [
        ("healthy", 4),
        ("draining", 1),
        ("relaunching", 1),
        ("unknown", 1),
        ("unhealthy", 1),
    ]


def test_the_filter_matches_id_model_status_and_engine_substrings() -> None:
    gpu = node("gpu01", model="Qwen/Qwen3-8B")
    assert matches(gpu, "") and matches(gpu, "GPU0") and matches(gpu, "qwen3") and matches(gpu, "health")
    assert matches(gpu, "llama_") and not matches(gpu, "vllm")


def test_devices_and_training_context_come_from_the_runtime_record() -> None:
    gpu = node("gpu01", llamacpp_runtime=runtime(gpus=((1000, 8000), (2000, 8000)), train=4096))
    assert gpu_totals(gpu) == (3000, 16000) and training_context(gpu) == 4096
    assert [(d.index, d.kind, d.free_mib) for d in devices_of(gpu)] == [(0, "nvidia", 7000), (1, "nvidia", 6000)]
    cpu = node("cpu01", llamacpp_runtime=runtime(cpu=True, gpus=((950, 24105),)))
    assert [(d.kind, d.name) for d in devices_of(cpu)] == [("cpu", "CPU (system memory)")]
    bare = node("vllm01", engine="vllm")
    assert gpu_totals(bare) is None and devices_of(bare) == [] and training_context(bare) is None


def test_a_failed_or_cancelled_turn_is_never_sent_as_history() -> None:
    chat = Conversation(system_prompt="Be brief.")
    first, messages = chat.start("one", model="m", at_s=0.0)
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one"}]
    first.add("uno", at_s=1.0)
    first.finish(TurnState.DONE, at_s=2.0)
    for state in (TurnState.CANCELLED, TurnState.FAILED):
        turn, _ = chat.start("lost", model="m", at_s=3.0)
        turn.add("half an ans", at_s=3.5)
        turn.finish(state, at_s=4.0, error="boom")
        assert turn.answer == "half an ans", "the partial answer stays in the transcript"
    _, messages = chat.start("two", model="m", at_s=5.0)
    assert [m["content"] for m in messages] == ["Be brief.", "one", "uno", "two"]


def test_tokens_per_second_count_from_the_first_token() -> None:
    turn, _ = Conversation().start("x", model="m", at_s=0.0)
    assert turn.tokens_per_s(1.0) is None
    for i in range(11):
        turn.add("t", at_s=1.0 + i * 0.1)
    assert turn.tokens_per_s(2.0) == pytest.approx(10.0)
    turn.finish(TurnState.DONE, at_s=3.0)
    turn.finish(TurnState.FAILED, at_s=9.0)
    assert turn.state is TurnState.DONE and turn.tokens_per_s(100.0) == pytest.approx(5.0)


def test_the_sizing_form_asks_the_core() -> None:
    chat = node("cpu01", llamacpp_runtime=runtime(sizing="custom", context_per_slot=2048, slots=2, train=2048))
    assert chat.llamacpp_runtime is not None
    values = SizingValues.from_runtime(chat.llamacpp_runtime)
    assert values == SizingValues("custom", "512", "2048", "2", "f16") and check_sizing(values, chat) == []
    typed = values.with_value("context_per_slot", "12a")
    assert [(v.field, v.message) for v in check_sizing(typed, chat)] == [
        ("context_per_slot", "context_per_slot must be a whole number of tokens, got '12a'.")
    ]
    assert typed.policy()["context_per_slot"] == "12a"
    # Thousands separators, consistently grouped, are fine; anything looser is quoted back by the core.
    for text, parsed in [("2,048", 2048), ("2_048", 2048), (" 2048 ", 2048), ("-256", -256)]:
        assert values.with_value("context_per_slot", text).policy()["context_per_slot"] == parsed
    for loose in ["1,,0,2,4", ",,,2048", "２０４８", "20,48", "2,048_000"]:
        assert values.with_value("context_per_slot", loose).policy()["context_per_slot"] == loose
    huge = values.with_value("fit_target_mib", "999999")
    assert [v.field for v in check_sizing(huge, chat)] == ["fit_target_mib"]
    auto_record = node("n", llamacpp_runtime=runtime()).llamacpp_runtime
    assert auto_record is not None
    auto = SizingValues.from_runtime(auto_record)
    assert auto.sizing == "auto" and auto.policy() == {"sizing": "auto", "fit_target_mib": 512}


def test_the_preview_is_arithmetic_on_the_form_and_the_running_server() -> None:
    record = node("n", llamacpp_runtime=runtime(context_per_slot=2048, slots=2)).llamacpp_runtime
    q8 = SizingValues("custom", "512", "1000", "3", "q8_0")
    assert sizing_preview(q8, record) == [
        "Aggregate context: ceil256(1,000 × 3) = 3,072 tokens",
        "K/V cache ≈ 0.40× the running server's (3,072 q8_0 cells vs 4,096 f16)",
    ]
    assert "enter a context per slot" in sizing_preview(q8.with_value("slots", ""), record)[0]
    absurd = sizing_preview(q8.with_value("context_per_slot", str(10**22)), record)
    assert len(absurd) == 2 and "no K/V cache to compare" in absurd[1]
    assert "at least 4,096 tokens" in sizing_preview(SizingValues(), record)[0]
    # With a sliding window the ratio is the full-attention cache's, and says so.
    windowed = record.model_copy(update={"memory": [{"kind": "kv", "cells": 4096}, {"kind": "kv_swa", "cells": 1536}]})
    (_, line) = sizing_preview(q8, windowed)
    assert (
        line.startswith("Full-attention K/V cache ≈ 0.40×") and "window or recurrent cache grows with the slots" in line
    )


def test_connection_problems_name_the_cause_and_what_to_check() -> None:
    down = describe_problem(DaemonUnreachable("refused"), url="http://h:1", source="defaults", username=None)
    assert down.kind == "unreachable" and down.cause == "refused" and "qiip up" in down.checks[0]
    refused = describe_problem(Unauthorized("401"), url="http://h:1", source="/etc/c.toml", username="ops")
    assert refused.kind == "unauthorized" and "user 'ops', from /etc/c.toml" in refused.title
    assert "no credentials" in describe_problem(Unauthorized("401"), url="u", source="defaults", username=None).title
    other = describe_problem(
        ApiError("gone", status=404, code="not_found", violations=[]), url="u", source="s", username=None
    )
    assert other.kind == "refused" and "HTTP 404, not_found" in other.title


def test_retries_back_off_to_a_cap() -> None:
    assert [retry_delay_s(n, (1.0, 2.0, 4.0)) for n in (1, 2, 3, 4, 10)] == [1.0, 2.0, 4.0, 4.0, 4.0]
