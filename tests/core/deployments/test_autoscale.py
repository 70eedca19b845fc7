"""The autoscaling policy as a pure function over time: windows, cooldown, bounds, recommend mode, scale to and
from zero, and state that survives a controller's restart."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from qiip_core.deployments import AutoscaleStatus
from qiip_core.deployments._autoscale import Demand, autoscale
from qiip_core.deployments._spec import Autoscale

T0 = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)


def policy(**changes: Any) -> Autoscale:
    base: dict[str, Any] = {
        "min": 1,
        "max": 3,
        "metric": "in_flight_per_slot",
        "target": 1.0,
        "up_window_s": 30,
        "down_window_s": 60,
        "cooldown_s": 45,
        "mode": "active",
    }
    return Autoscale.model_validate({**base, **changes})


def run(
    p: Autoscale, loads: Sequence[tuple[float, int]], replicas: int = 1, slots_per_replica: int = 2
) -> list[tuple[float, int, str]]:
    """Feed `(seconds from T0, requests in flight)` steps, applying `desired` as the new replica count at once."""
    state = AutoscaleStatus()
    out = []
    for at, in_flight in loads:
        now = T0 + timedelta(seconds=at)
        demand = Demand(
            in_flight=in_flight, slots=replicas * slots_per_replica, last_request_at=now if in_flight else None
        )
        state = autoscale(p, state, demand=demand, replicas=replicas, ready=replicas, now=now)
        if state.desired is not None:
            replicas = state.desired
        out.append((at, replicas, state.reason or ""))
    return out


def test_load_above_target_for_the_up_window_scales_up_to_what_the_load_needs() -> None:
    steps = run(policy(), [(t, 6) for t in range(0, 40, 5)])
    assert [r for at, r, _ in steps if at < 30] == [1] * 6  # inside the up window
    assert steps[6][1] == 3  # 6 in flight over 2 slots at target 1 per slot: 3 replicas (the max)


def test_scale_down_is_one_replica_per_cooldown_after_the_down_window() -> None:
    up = [(t, 6) for t in range(0, 35, 5)]
    down = [(t, 0) for t in range(35, 300, 5)]
    steps = run(policy(), up + down)
    counts = {at: r for at, r, _ in steps}
    assert counts[30] == 3
    first_down = min(at for at, r, _ in steps if at > 30 and r == 2)
    assert first_down - 35 >= 60  # the down window
    second_down = min(at for at, r, _ in steps if r == 1 and at > first_down)
    assert second_down - first_down >= 45  # the cooldown
    assert min(r for _, r, _ in steps) == 1  # never below min


def test_recommend_mode_computes_the_same_counts_and_changes_nothing() -> None:
    state = AutoscaleStatus()
    for at in range(0, 40, 5):
        now = T0 + timedelta(seconds=at)
        state = autoscale(
            policy(mode="recommend"), state, demand=Demand(in_flight=6, slots=2), replicas=1, ready=1, now=now
        )
    assert state.desired is None and state.recommendation == 3


def test_with_min_zero_an_idle_model_releases_its_last_replica_and_a_request_brings_one_back() -> None:
    p = policy(min=0, down_window_s=60, cooldown_s=0)
    steps = run(p, [(0, 1)] + [(t, 0) for t in range(5, 130, 5)])
    assert steps[-1][1] == 0
    state = AutoscaleStatus(last_scale_at=T0 + timedelta(seconds=125))
    woke = autoscale(p, state, demand=Demand(queued=1), replicas=0, ready=0, now=T0 + timedelta(seconds=126))
    assert woke.desired == 1 and "at zero replicas" in (woke.reason or "")


def test_the_windows_survive_a_new_controller_reading_the_stored_state() -> None:
    p = policy()
    state = AutoscaleStatus()
    for at in (0, 10, 20):
        state = autoscale(
            p, state, demand=Demand(in_flight=6, slots=2), replicas=1, ready=1, now=T0 + timedelta(seconds=at)
        )
    stored = AutoscaleStatus.model_validate_json(state.model_dump_json())  # what another gateway reads
    after = autoscale(
        p, stored, demand=Demand(in_flight=6, slots=2), replicas=1, ready=1, now=T0 + timedelta(seconds=31)
    )
    assert after.desired == 3  # the window began at 0, not at the takeover
    again = autoscale(
        p, after, demand=Demand(in_flight=6, slots=6), replicas=3, ready=3, now=T0 + timedelta(seconds=32)
    )
    assert again.desired == 3  # at max: no burst of further decisions
