"""The control channel's messages (`qiip_proxy._control`): each one survives `encode` then `decode` unchanged, a
malformed line of each kind is refused with `ControlError` alone, and a worker's counters reach the primary's metrics
whatever characters their labels hold."""

from __future__ import annotations

import pytest

from qiip_core.nodes import Engine, Node, NodeStatus
from qiip_core.routing import AffinityResult, ExpectedModel, PrefixAffinity, RoutingPolicy, RoutingTable
from qiip_proxy._control import (
    ControlError,
    ControlMessage,
    Expected,
    Hello,
    NodeDelete,
    NodePut,
    Ready,
    Report,
    Shared,
    TokensChanged,
    decode,
    encode,
)
from qiip_proxy._metrics import Accounted, GatewayMetrics

ODD = 'm\x1f"\n\\ é/\u2028'
"""A model name with the old separator, quotes, a newline, a backslash and non-ASCII characters."""

NODE = Node(
    id="n-1", endpoint="http://127.0.0.1:9", model='q"é/日本\\', engine=Engine.LLAMA_CPP, status=NodeStatus.HEALTHY
)

SHARED = Shared(prefixes=(("n-1", (1, -(2**63), 2**63 - 1)),), admin_auth_failed=("127.0.0.5",))

REQUESTS = (
    Accounted(ODD, "n-1", 200, None, 0.25, 0.05, (), None, (54, 3)),
    Accounted("m", "", 502, "failover_exhausted", 1.5, None, (("a", "connect"), ("", "timeout")), None, None),
    Accounted("m", "n-1", 200, "upstream_error", 2.0, 0.1, (), "truncated", None),
)

MESSAGES: list[ControlMessage] = [
    Hello(row=3),
    NodePut(node=NODE, source="embedded", column=4, slots=(1, 2)),
    NodePut(node=NODE, source="attached", column=None, slots=None),
    NodeDelete(node_id="n-1"),
    Expected(models={ODD: ExpectedModel("its local node n-1 is starting", 5.0, wait_s=30.0, queue=8)}),
    Expected(models={}),
    SHARED,
    Shared(),
    Ready(),
    TokensChanged(),
    Report(),
    Report(
        requests=REQUESTS,
        counters=(
            (("shed", ODD, "max_in_flight"), 2.0),
            (("auth_failures", "client"), 1.0),
            (("affinity", ODD, AffinityResult.HIT), 7.0),
        ),
        queued={ODD: 2},
        shared=SHARED,
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.kind)
def test_every_message_survives_a_round_trip_on_one_line(message: ControlMessage) -> None:
    line = encode(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode(line) == message


def test_a_report_s_requests_become_the_metrics_records_again() -> None:
    decoded = decode(encode(Report(requests=REQUESTS)))
    assert isinstance(decoded, Report)
    assert [Accounted._make(row) for row in decoded.requests] == list(REQUESTS)


MALFORMED = [
    b"",
    b"not json",
    b"[1, 2]",
    b'{"row": 1}',
    b'{"kind": "goodbye"}',
    b'{"kind": "hello", "row": 0}',
    b'{"kind": "hello", "row": "one"}',
    b'{"kind": "put", "node": {"id": "n"}, "source": "embedded", "column": 1, "slots": null}',
    b'{"kind": "put", "node": ' + NODE.model_dump_json().encode() + b', "source": "x", "column": 1, "slots": [1]}',
    b'{"kind": "delete"}',
    b'{"kind": "expected", "models": {"m": {"why": 3}}}',
    b'{"kind": "shared", "prefixes": [["n", ["not-a-hash"]]]}',
    b'{"kind": "shared", "admin_auth_failed": "127.0.0.1"}',
    b'{"kind": "ready", "now": true}',
    b'{"kind": "tokens", "tokens": 1}',
    b'{"kind": "report", "requests": [["m", "n", 200]]}',
    b'{"kind": "report", "counters": [[["shed", "m"], 1.0]]}',
    b'{"kind": "report", "counters": [[["affinity", "m", "maybe"], 1.0]]}',
    b'{"kind": "report", "counters": {"shed\\u001fm\\u001fmax_in_flight": 1.0}}',
    b'{"kind": "report", "queued": {"m": "many"}}',
    # Totals and durations are finite and not negative: one infinity would stay in a Prometheus sum for good.
    b'{"kind": "report", "counters": [[["auth_failures", "admin"], 1e309]]}',
    b'{"kind": "report", "counters": [[["auth_failures", "admin"], "Infinity"]]}',
    b'{"kind": "report", "counters": [[["auth_failures", "admin"], -1.0]]}',
]


@pytest.mark.parametrize("line", MALFORMED)
def test_a_malformed_line_of_any_kind_is_refused_with_one_error(line: bytes) -> None:
    with pytest.raises(ControlError, match="^a malformed control message: "):
        decode(line)


def test_counters_with_odd_characters_in_their_labels_reach_the_primary_s_metrics() -> None:
    def metrics() -> GatewayMetrics:
        affinity = PrefixAffinity(policy=RoutingPolicy.PREFIX_AFFINITY, max_entries=16, ttl_s=60.0)
        return GatewayMetrics(RoutingTable(affinity=affinity))

    worker, primary = metrics(), metrics()
    worker.shed.labels(ODD, "max_in_flight").inc(2)
    worker.auth_failures.labels("client").inc()
    assert worker._table.affinity is not None
    worker._table.affinity.results[ODD, AffinityResult.HIT] = 7
    counted = worker.counted()
    assert counted == {
        ("shed", ODD, "max_in_flight"): 2.0,
        ("auth_failures", "client"): 1.0,
        ("affinity", ODD, AffinityResult.HIT): 7,
    }
    report = decode(encode(Report(counters=tuple(counted.items()))))
    assert isinstance(report, Report) and report.counters is not None
    for key, value in report.counters:
        primary.add_counted(key, value)
    assert primary.counted() == counted
    assert primary.registry.get_sample_value("qiip_requests_shed_total", {"model": ODD, "reason": "max_in_flight"}) == 2
