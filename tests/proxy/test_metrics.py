"""The metrics' parts without a daemon: the `usage` found at the end of an answer, the kind of a node's error,
and what one `Outcome` adds to the registry."""

from __future__ import annotations

import json

import pytest

from qiip_core import (
    FailoverExhausted,
    UpstreamConnectError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamTransportError,
)
from qiip_core.routing import RoutingTable
from qiip_proxy._metrics import (
    TTFT_BUCKETS,
    UPSTREAM_ERROR_KINDS,
    USAGE_WINDOW_BYTES,
    GatewayMetrics,
    Outcome,
    Usage,
    find_usage,
    upstream_error_kind,
)

DONE = b"data: [DONE]\n\n"
LLAMA_USAGE_CHUNK = (
    b'data: {"choices":[],"created":1,"id":"chatcmpl-x","model":"tiny.gguf","object":"chat.completion.chunk",'
    b'"usage":{"completion_tokens":3,"prompt_tokens":54,"total_tokens":57,"prompt_tokens_details":'
    b'{"cached_tokens":53}},"timings":{"cache_n":53,"prompt_n":1}}\n\n'
)
"""llama-server's last chunk of a chat stream asked with `stream_options.include_usage` (its real output)."""


def chunk(content: str, *, usage: object = None, with_usage_key: bool = False) -> bytes:
    body: dict[str, object] = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": content}}]}
    if usage is not None or with_usage_key:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


@pytest.mark.parametrize(
    ("before", "last", "expected"),
    [
        # A stream: the usage chunk, then `[DONE]` in a read of its own, or both in one read.
        (LLAMA_USAGE_CHUNK, DONE, Usage(54, 3)),
        (chunk("a"), LLAMA_USAGE_CHUNK + DONE, Usage(54, 3)),
        # OpenAI's `"usage": null` on every chunk but the last is not a usage.
        (chunk("a", with_usage_key=True), chunk("b", with_usage_key=True) + DONE, None),
        (b"", chunk("a", with_usage_key=True) + chunk("", usage={"prompt_tokens": 7, "completion_tokens": 2}), (7, 2)),
        # A stream without usage (a chat stream to llama-server that did not ask for it).
        (chunk("a"), chunk("b") + DONE, None),
        # A JSON body, spaced as Python's json writes it; embeddings have no completion tokens.
        (b"", json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}}).encode(), (5, 9)),
        (b"", json.dumps({"data": [], "usage": {"prompt_tokens": 4, "total_tokens": 4}}).encode(), (4, 0)),
        # The word as a value, the key quoted inside a string, and usage that is not counts are all skipped.
        (b"", b'{"content": "usage", "text": "say \\"usage\\": {1}"}', None),
        (b"", b'{"usage": {"prompt_tokens": "5", "completion_tokens": 1}}', None),
        (b"", b'{"usage": {"prompt_tokens": -1}}', None),
        (b"", b'{"usage": {"prompt_tokens": true}}', None),
        # A count no answer can have (a float counter would overflow on it) is not believed either.
        (b"", b'{"usage": {"prompt_tokens": 1' + b"0" * 400 + b', "completion_tokens": 1}}', None),
        (b"", b'{"usage": {"prompt_tokens": 1099511627776, "completion_tokens": 1}}', (1 << 40, 1)),
        # An answer cut inside its usage object.
        (b"", b'{"usage": {"prompt_tokens": 5, "compl', None),
        # A later usage wins: the last one is the answer's.
        (b"", b'{"a": {"usage": {"prompt_tokens": 1}}, "usage": {"prompt_tokens": 2}}', (2, 0)),
    ],
)
def test_find_usage(before: bytes, last: bytes, expected: tuple[int, int] | None) -> None:
    assert find_usage(before, last) == expected


def test_find_usage_looks_only_at_the_end_of_a_large_answer() -> None:
    usage = b'"usage": {"prompt_tokens": 3, "completion_tokens": 4}'
    padding = b'"x": "' + b"y" * USAGE_WINDOW_BYTES + b'"'
    assert find_usage(b"", b"{" + padding + b", " + usage + b"}") == (3, 4)
    assert find_usage(b"", b"{" + usage + b", " + padding + b"}") is None
    # Split over two pieces of a plain body: found in the two pieces together.
    body = b"{" + padding + b", " + usage + b"}"
    assert find_usage(body[:-20], body[-20:]) == (3, 4)


@pytest.mark.parametrize(
    ("error", "committed", "kind"),
    [
        (UpstreamConnectError("refused", node_id="n"), False, "connect"),
        (UpstreamTimeout("slow", node_id="n"), False, "timeout"),
        (UpstreamTimeout("silent", node_id="n"), True, "timeout"),
        (UpstreamStatusError("HTTP 503", node_id="n", status=503, body=b""), False, "status"),
        (UpstreamTransportError("reset", node_id="n"), False, "transport"),
        (UpstreamTransportError("reset", node_id="n"), True, "truncated"),
    ],
)
def test_upstream_error_kind(error: UpstreamError, committed: bool, kind: str) -> None:
    assert upstream_error_kind(error, committed=committed) == kind
    assert kind in UPSTREAM_ERROR_KINDS


def test_a_stream_ended_before_done_is_truncated_wherever_it_is_raised() -> None:
    """The hook for issue 11 item 1: a stream that ends before `[DONE]` fails with the code `upstream_error`."""
    error = UpstreamTransportError("the stream ended before [DONE].", node_id="n")
    error.code = "upstream_error"
    assert upstream_error_kind(error, committed=False) == "truncated"


def test_ttft_buckets_span_10_ms_to_60_s() -> None:
    assert TTFT_BUCKETS[0] == 0.01 and TTFT_BUCKETS[-1] == 60.0
    assert list(TTFT_BUCKETS) == sorted(set(TTFT_BUCKETS))


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_an_answer_after_failover_counts_attempts_errors_and_usage() -> None:
    metrics = GatewayMetrics(RoutingTable())
    failures: list[UpstreamError] = [
        UpstreamConnectError("refused", node_id="a"),
        UpstreamStatusError("HTTP 503", node_id="b", status=503, body=b""),
    ]
    outcome = Outcome(started=0.0, model="m", node="c", status=200, failures=failures, first_token_s=0.3)
    outcome.answer_end = (LLAMA_USAGE_CHUNK, DONE)
    metrics.account(outcome)
    assert sample(metrics, "qiip_upstream_errors_total", model="m", node="a", kind="connect") == 1
    assert sample(metrics, "qiip_upstream_errors_total", model="m", node="b", kind="status") == 1
    assert sample(metrics, "qiip_upstream_retries_total", model="m", node="a") == 1
    assert sample(metrics, "qiip_upstream_retries_total", model="m", node="b") == 1
    # Failed over from a to b, then from b to c.
    assert sample(metrics, "qiip_failover_attempts_total", model="m", node="a") == 0
    assert sample(metrics, "qiip_failover_attempts_total", model="m", node="b") == 1
    assert sample(metrics, "qiip_failover_attempts_total", model="m", node="c") == 1
    assert sample(metrics, "qiip_prompt_tokens_total", model="m", node="c") == 54
    assert sample(metrics, "qiip_completion_tokens_total", model="m", node="c") == 3
    assert sample(metrics, "qiip_time_to_first_token_seconds_bucket", model="m", node="c", le="0.35") == 1
    assert sample(metrics, "qiip_time_to_first_token_seconds_bucket", model="m", node="c", le="0.2") == 0


def test_exhausted_failover_retried_every_node_but_the_last() -> None:
    metrics = GatewayMetrics(RoutingTable())
    failures: list[UpstreamError] = [UpstreamTimeout("slow", node_id=n) for n in ("a", "b", "c")]
    error = FailoverExhausted(attempts=3, last=failures[-1], failures=failures)
    metrics.account(Outcome(started=0.0, model="m", status=error.status, error_code=error.code, failures=failures))
    assert [sample(metrics, "qiip_upstream_retries_total", model="m", node=n) for n in "abc"] == [1, 1, 0]
    assert [sample(metrics, "qiip_failover_attempts_total", model="m", node=n) for n in "abc"] == [0, 1, 1]
    assert sample(metrics, "qiip_upstream_errors_total", model="m", kind="timeout", node="c") == 1
    assert sample(metrics, "qiip_request_errors_total", model="m", node="", code="failover_exhausted") == 1


def test_a_cut_stream_counts_truncated_and_no_usage() -> None:
    metrics = GatewayMetrics(RoutingTable())
    error = UpstreamTransportError("reset", node_id="n")
    outcome = Outcome(started=0.0, model="m", node="n", status=200, error_code=error.code, relay_error=error)
    metrics.account(outcome)
    assert sample(metrics, "qiip_upstream_errors_total", model="m", node="n", kind="truncated") == 1
    assert sample(metrics, "qiip_prompt_tokens_total", model="m", node="n") == 0
    assert sample(metrics, "qiip_failover_attempts_total", model="m", node="n") == 0


def test_usage_of_an_error_answer_and_of_a_non_stream_answer() -> None:
    metrics = GatewayMetrics(RoutingTable())
    body = json.dumps({"usage": {"prompt_tokens": 5, "completion_tokens": 1}}).encode()
    metrics.account(Outcome(started=0.0, model="m", node="n", status=400, answer_end=(b"", body)))
    assert sample(metrics, "qiip_prompt_tokens_total", model="m", node="n") == 0
    metrics.account(Outcome(started=0.0, model="m", node="n", status=200, answer_end=(b"", body)))
    assert sample(metrics, "qiip_prompt_tokens_total", model="m", node="n") == 5
    assert sample(metrics, "qiip_completion_tokens_total", model="m", node="n") == 1
    # A non-streaming answer has no time to first token.
    assert sample(metrics, "qiip_time_to_first_token_seconds_count", model="m", node="n") == 0
