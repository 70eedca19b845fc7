"""The per-model admission bound: absolute, derived from slots, the lower of both, and the shed error."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from qiip_core import ConfigError, ModelOverloaded
from qiip_core.config import AdmissionSettings, load_settings
from qiip_core.nodes import Node, NodeStatus
from qiip_core.routing import Admission, BreakerPolicy, RoutingTable
from qiip_proxy._errors import describe_error


def table_with(*node_ids: str, model: str = "m") -> RoutingTable:
    table = RoutingTable(breaker=BreakerPolicy(min_failures=3), rng=random.Random(1))
    for i, node_id in enumerate(node_ids):
        node = Node(id=node_id, endpoint=f"http://127.0.0.1:{8001 + i}", model=model, status=NodeStatus.HEALTHY)
        table.apply_put(node, source="test")
    return table


def test_off_by_default_admits_everything() -> None:
    table = table_with("a")
    admission = Admission(table, AdmissionSettings())
    held = [table.reserve("m") for _ in range(1000)]
    admission.admit("m")
    assert not admission.enabled and admission.bound("m") is None
    for reservation in held:
        reservation.release()


def test_the_absolute_bound_counts_reservations_on_every_node_of_the_model() -> None:
    table = table_with("a", "b")
    admission = Admission(table, AdmissionSettings(max_in_flight=3))
    held = [table.reserve("m") for _ in range(3)]
    with pytest.raises(ModelOverloaded) as shed:
        admission.admit("m")
    assert shed.value.status == 429 and shed.value.reason == "max_in_flight" and shed.value.retry_after_s == 1
    held.pop().release()
    admission.admit("m")
    # Other models are not counted, and a model without nodes is never shed (the table answers it).
    admission.admit("other")


def test_the_derived_bound_follows_the_slots_of_healthy_nodes() -> None:
    table = table_with("a", "b")
    admission = Admission(table, AdmissionSettings(queue_per_slot=0.5))
    assert admission.bound("m") is None  # no node reports slots yet
    a, b = table.get("a"), table.get("b")
    assert a is not None and b is not None
    a.slots, b.slots = (0, 2), (0, 4)
    bound = admission.bound("m")
    assert bound is not None and (bound.limit, bound.reason, bound.slots) == (9, "queue_per_slot", 6)
    table.set_liveness("b", NodeStatus.UNHEALTHY)
    bound = admission.bound("m")
    assert bound is not None and bound.limit == 3
    held = [table.reserve("m") for _ in range(3)]
    with pytest.raises(ModelOverloaded) as shed:
        admission.admit("m")
    assert "2 slots, admission.queue_per_slot = 0.5" in shed.value.message
    for reservation in held:
        reservation.release()


def test_the_lower_bound_holds_and_a_models_own_fields_override_the_defaults() -> None:
    table = table_with("a")
    state = table.get("a")
    assert state is not None
    state.slots = (0, 4)
    settings = AdmissionSettings(
        max_in_flight=100, queue_per_slot=1, models={"m": {"max_in_flight": 6}}, status=503, retry_after_s=5
    )
    admission = Admission(table, settings)
    bound = admission.bound("m")
    assert bound is not None and (bound.limit, bound.reason) == (6, "max_in_flight")
    assert settings.for_model("m") == (6, 1) and settings.for_model("x") == (100, 1)
    held = [table.reserve("m") for _ in range(6)]
    with pytest.raises(ModelOverloaded) as shed:
        admission.admit("m")
    status, body, headers = describe_error(shed.value)
    assert status == 503 and headers == {"Retry-After": "5"}
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("service_unavailable_error", "model_overloaded")
    for reservation in held:
        reservation.release()


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[admission]\nstatus = 500\n", "admission.status (QIIP_ADMISSION__STATUS): Input should be 429 or 503"),
        ("[admission]\nmax_in_flight = 0\n", "admission.max_in_flight (QIIP_ADMISSION__MAX_IN_FLIGHT)"),
        ('[admission.models."m"]\nqueue_per_slot = -1\n', "admission.models.m.queue_per_slot"),
        ('[admission.models."m"]\nmax_inflight = 3\n', "admission.models.m.max_inflight: unknown setting"),
        ('[admission.models.""]\nmax_in_flight = 3\n', "an entry with an empty model name"),
    ],
)
def test_invalid_admission_settings_name_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, fragment: str
) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "qiip.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert fragment in info.value.message
