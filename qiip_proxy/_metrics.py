"""The last step of an inference request: account. Prometheus metrics of the client API (`GET /metrics`).

Every inference request ends as one `Outcome`, filled in as it goes and accounted once, when it ends
(`GatewayMetrics.account`); per-node gauges (in-flight requests, status, breaker) are read from the routing
table when Prometheus scrapes, so the request path never touches a gauge (nor the prefix-affinity counts,
which the table keeps as plain integers).

Names and units follow Prometheus' conventions (https://prometheus.io/docs/practices/naming/): a base unit
in the name (`_seconds`), `_total` on every counter (prometheus-client appends it), and label sets that stay
bounded: `model` is a model some node serves (empty otherwise), `node` a registered node's id, and every
other label takes values from a short fixed list (`UPSTREAM_ERROR_KINDS`, statuses, error codes).

The token counters read the `usage` object the node reports (OpenAI's `CompletionUsage`:
https://platform.openai.com/docs/api-reference/chat/object#chat/object-usage), without parsing the answer:
`find_usage` looks only at the end of it, where every server puts `usage` (the last data event before
`[DONE]` of a stream; the end of a JSON body), and parses just that object.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from qiip_core import UpstreamConnectError, UpstreamError, UpstreamStatusError, UpstreamTimeout
from qiip_core.nodes import NodeStatus
from qiip_core.routing import AffinityResult, RoutingTable

__all__ = [
    "UPSTREAM_ERROR_KINDS",
    "Accounted",
    "CounterKey",
    "GatewayMetrics",
    "Outcome",
    "Usage",
    "find_usage",
    "summarize",
    "upstream_error_kind",
]

TTFT_WINDOW = 256
"""How many recent streaming requests per node the admin metrics' `ttft_p50_s` is the median of."""

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
"""Upper bounds (seconds) of the time-to-first-token histogram: 10 ms (a cached prompt on a small model, one
hop away) to 60 s (a long prompt on a large model under load), finest between 0.1 and 2.5 s, where
interactive chat lives and where `histogram_quantile` needs the resolution. Slower first tokens land in
`+Inf` (the forwarder's first-byte timeout, `upstream.ttfb_timeout_s`, is 120 s by default)."""

UPSTREAM_ERROR_KINDS = ("connect", "timeout", "status", "transport", "truncated")
"""The `kind` label of `qiip_upstream_errors_total`, as `upstream_error_kind` assigns it."""

USAGE_WINDOW_BYTES = 64 * 1024
"""How far from the end of an answer `find_usage` looks for its `usage` object: the end of a JSON body
(llama-server sorts its keys, so `usage` follows `choices` and `data`; vLLM and OpenAI put it after them too),
or the last events of a stream."""

_USAGE_OBJECT_BYTES = 2048
"""The most of a `usage` object parsed: its counts and their `*_details` fit in a few hundred bytes."""

_USAGE_VALUE = re.compile(rb'"usage"[ \t\r\n]*:[ \t\r\n]*\{')
"""The `usage` key with an object for its value (not `"usage": null`, which OpenAI streams put on every
chunk but the last, nor the string "usage" as a value)."""

_DECODER = json.JSONDecoder()

ShedKey = tuple[Literal["shed"], str, str]
"""A `GatewayMetrics.counted` key of `qiip_requests_shed_total`: `("shed", model, reason)`."""

AuthFailuresKey = tuple[Literal["auth_failures"], str]
"""A `GatewayMetrics.counted` key of `qiip_auth_failures_total`: `("auth_failures", api)`."""

AffinityKey = tuple[Literal["affinity"], str, AffinityResult]
"""A `GatewayMetrics.counted` key of `qiip_prefix_affinity_total`: `("affinity", model, result)`."""

CounterKey = ShedKey | AuthFailuresKey | AffinityKey
"""One counter a worker keeps besides its requests (`GatewayMetrics.counted`): the counter's name, then its label
values in the counter's order."""


class Usage(NamedTuple):
    """The tokens a node reports for one answer (OpenAI's `usage`; a count it leaves out is 0)."""

    prompt_tokens: int
    """Tokens of the prompt (`usage.prompt_tokens`)."""
    completion_tokens: int
    """Tokens generated (`usage.completion_tokens`; embeddings have none)."""


def find_usage(before: bytes, last: bytes) -> Usage | None:
    """The `usage` a node reported at the end of its answer, found without parsing the rest of it.

    The last `"usage": {` within `USAGE_WINDOW_BYTES` of the end is parsed alone (at most 2 KiB of it). For a
    stream, that is the last data event before `[DONE]` that carries usage: llama-server sends it on
    `/v1/completions` streams always, and on chat streams when the client asks with
    `stream_options.include_usage` (as OpenAI and vLLM do), in a last chunk with empty `choices` (as the
    installed llama-server, commit 0c1e570, does in `tests/proxy/test_metrics_scrape.py`).

    Args:
        before: the piece of the answer relayed before `last` (b"" when there was none).
        last: the last piece of the answer: a stream's last events, or the whole body of a buffered one.

    Returns:
        The prompt and completion tokens, or None when the end of the answer carries no usable `usage`.
    """
    if len(last) < USAGE_WINDOW_BYTES and before:
        # `[DONE]` often comes in a read of its own, after the event that carries the usage.
        last = before[len(last) - USAGE_WINDOW_BYTES :] + last
    start = max(0, len(last) - USAGE_WINDOW_BYTES)
    end = len(last)
    while (at := last.rfind(b'"usage"', start, end)) >= 0:
        end = at
        found = _USAGE_VALUE.match(last, at)
        if found is None:
            continue
        text = last[found.end() - 1 : found.end() - 1 + _USAGE_OBJECT_BYTES].decode("utf-8", "replace")
        try:
            usage, _ = _DECODER.raw_decode(text)
        except ValueError:
            continue
        prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        if _is_count(prompt) and _is_count(completion):
            return Usage(prompt, completion)
    return None


MAX_USAGE_TOKENS = 1 << 40
"""The largest token count of one answer believed (about 10^12, far beyond any context): a node that reports more
is not counted, as one that reports a negative or non-integer count is not, so no answer can overflow a counter."""


def _is_count(value: object) -> bool:
    return type(value) is int and 0 <= value <= MAX_USAGE_TOKENS


def upstream_error_kind(error: UpstreamError, *, committed: bool) -> str:
    """What kind of failure a node's error is, for the `kind` label of `qiip_upstream_errors_total`.

    Args:
        error: the node's error.
        committed: True when it broke off an answer the gateway had committed to (mid-stream, mid-body);
            False for a failed attempt before that (failed over when attempts remained).

    Returns:
        `connect`: the node could not be reached; `timeout`: it was too slow (to connect, to its first byte,
        between chunks, or past its deadline); `status`: it answered 5xx; `truncated`: a committed answer
        broke off (the connection broke, or a stream ended before `[DONE]`); `transport`: any other broken
        connection before the answer was committed (reset, closed, a malformed response, a stream that ended
        before its first event).
    """
    if isinstance(error, UpstreamTimeout):
        return "timeout"
    if isinstance(error, UpstreamStatusError):
        return "status"
    if isinstance(error, UpstreamConnectError):
        return "connect"
    # Hook for a stream that ends cleanly but before `[DONE]` (issue 11, item 1): its error carries the code
    # `upstream_error`, and it is a truncation wherever it is raised.
    if committed or error.code == "upstream_error":
        return "truncated"
    return "transport"


@dataclass(slots=True)
class Outcome:
    """How one client request ended, as the metrics record it.

    Attributes:
        started: when the request arrived (`time.perf_counter()`, seconds).
        model: the requested model ("" before it is known, and for a model no node serves).
        node: the node that answered ("" when none did).
        status: the HTTP status the client got (499 when it left first); None while the request has not
            ended for the client, and for a request the daemon stopped before it had an answer (not
            accounted).
        duration_s: time to the last byte, in seconds.
        first_token_s: seconds from `started` to the first `data:` event of a stream reaching the client;
            None for a non-streaming answer, and for a stream that ended before any.
        error_code: the OpenAI error code when the request failed (also mid-stream), else None.
        failures: the failed attempts, oldest first: those before the node that answered, or every attempt
            when none did.
        relay_error: the node's error that broke off its committed answer (mid-stream, mid-body), else None.
        answer_end: the last two pieces of an answer relayed to its end (`(b"", body)` for a buffered one),
            where `usage` is looked for; None for an answer not relayed to its end.
    """

    started: float
    model: str = ""
    node: str = ""
    status: int | None = None
    duration_s: float = 0.0
    first_token_s: float | None = None
    error_code: str | None = None
    failures: Sequence[UpstreamError] = ()
    relay_error: UpstreamError | None = None
    answer_end: tuple[bytes, bytes] | None = None


class Accounted(NamedTuple):
    """One finished client request as the metrics record it (`GatewayMetrics.record`): an `Outcome` reduced to
    plain values, which a worker process (`server.workers`) sends to the primary (`_control.Report`)."""

    model: str
    """The requested model ("" when unknown)."""
    node: str
    """The node that answered ("" when none did)."""
    status: int
    """The HTTP status the client got (499 when it left first)."""
    error_code: str | None
    """The OpenAI error code when the request failed, else None."""
    duration_s: float
    """Time to the last byte, in seconds."""
    first_token_s: float | None
    """Seconds to the first `data:` event of a stream, else None."""
    failures: tuple[tuple[str, str], ...]
    """The failed attempts, oldest first: the node id ("" when none was reached) and `upstream_error_kind`."""
    relay_kind: str | None
    """`upstream_error_kind` of the error that broke the committed answer, else None."""
    usage: tuple[int, int] | None
    """Prompt and completion tokens the node reported for a successful answer, else None."""


def summarize(outcome: Outcome) -> Accounted | None:
    """`outcome` as the metrics record it; None for a request without a status (not recorded)."""
    status = outcome.status
    if status is None:
        return None
    usage = None
    if outcome.node and outcome.answer_end is not None and status < 400:
        found = find_usage(*outcome.answer_end)
        if found is not None:
            usage = (found.prompt_tokens, found.completion_tokens)
    return Accounted(
        outcome.model,
        outcome.node,
        status,
        outcome.error_code,
        outcome.duration_s,
        outcome.first_token_s,
        tuple((f.node_id or "", upstream_error_kind(f, committed=False)) for f in outcome.failures),
        upstream_error_kind(outcome.relay_error, committed=True) if outcome.relay_error is not None else None,
        usage,
    )


class _TableCollector(Collector):
    def __init__(self, table: RoutingTable) -> None:
        self._table = table

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "qiip_in_flight_requests", "Requests in flight per node.", labels=["model", "node"]
        )
        up = GaugeMetricFamily(
            "qiip_node_status", "1 for the node's current status, per status.", labels=["node", "status"]
        )
        breaker = GaugeMetricFamily(
            "qiip_node_breaker_open",
            "1 when the node's circuit breaker is open or half-open.",
            labels=["node"],
        )
        resident = GaugeMetricFamily(
            "qiip_node_resident_bytes",
            "Memory an Ollama node's loaded model takes, as its last GET /api/ps said: memory=total (weights and KV "
            "cache) or memory=vram (the part in GPU memory).",
            labels=["node", "model", "memory"],
        )
        for state in self._table:
            in_flight.add_metric([state.node.model, state.id], state.in_flight)
            for status in NodeStatus:
                up.add_metric([state.id, status.value], 1.0 if state.status is status else 0.0)
            breaker.add_metric([state.id], 1.0 if state.breaker.is_open else 0.0)
            # Labelled with the node's model as clients name it (`llama3.2`, not Ollama's `llama3.2:latest`), as
            # every other per-model series is, so the two join on `model`.
            for loaded in state.resident or ():
                resident.add_metric([state.id, state.node.model, "total"], loaded.size_bytes)
                resident.add_metric([state.id, state.node.model, "vram"], loaded.vram_bytes)
        yield in_flight
        yield up
        yield breaker
        yield resident
        affinity = self._table.affinity
        if affinity is not None:
            routed = CounterMetricFamily(
                "qiip_prefix_affinity",
                "Requests routed by prefix affinity, by model and result: hit (sent to the node that served "
                "its longest known prefix), miss (none known on an eligible node), overloaded (that node was "
                "beyond the imbalance bound); misses and overloaded ones went by least-connections.",
                labels=["model", "result"],
            )
            for (model, result), count in list(affinity.results.items()):
                routed.add_metric([model, result.value], count)
            yield routed


def _series(metric: Counter | Histogram, cache: dict[tuple[str, str], Any], labels: tuple[str, str]) -> Any:
    """`metric.labels(*labels)`, created on first use (as `labels()` does) and then found in `cache`."""
    found = cache.get(labels)
    if found is None:
        found = cache[labels] = metric.labels(*labels)
    return found


def _totals(metric: Counter) -> Iterator[tuple[dict[str, str], float]]:
    """The `_total` samples of a counter: labels and value."""
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                yield sample.labels, sample.value


class GatewayMetrics:
    """The daemon's metrics, in a registry of its own (one per app, so tests can run several).

    Args:
        table: the routing table, read at scrape time for per-node gauges.
        on_finished: called with the model and the time to first token (seconds, or None) of every request a
            node answered, in any serving process (the autoscaler's `DemandMeter.finished`).
    """

    def __init__(self, table: RoutingTable, *, on_finished: Callable[[str, float | None], None] | None = None) -> None:
        self._table = table
        self._on_finished = on_finished
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "qiip_requests",
            "Client requests by model, serving node (empty when none) and HTTP status.",
            ["model", "node", "status"],
            registry=self.registry,
        )
        self.errors = Counter(
            "qiip_request_errors",
            "Failed client requests by model, node and error code.",
            ["model", "node", "code"],
            registry=self.registry,
        )
        self.shed = Counter(
            "qiip_requests_shed",
            "Client requests shed before reaching a node, by model and the bound reached ([admission]: "
            "max_in_flight, queue_per_slot).",
            ["model", "reason"],
            registry=self.registry,
        )
        self.auth_failures = Counter(
            "qiip_auth_failures",
            "Failed authentications by API: admin credentials, invoke tokens.",
            ["api"],
            registry=self.registry,
        )
        self.retries = Counter(
            "qiip_upstream_retries",
            "Attempts that failed and were retried on another node, by the node that failed.",
            ["model", "node"],
            registry=self.registry,
        )
        self.failover_attempts = Counter(
            "qiip_failover_attempts",
            "Attempts sent to another node after an attempt failed, by the node they went to.",
            ["model", "node"],
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            "qiip_upstream_errors",
            "Failures of nodes, by the node that failed and kind: connect, timeout, status, transport "
            "(before the answer was committed), truncated (a committed answer broke off).",
            ["model", "node", "kind"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "qiip_prompt_tokens",
            "Prompt tokens, as the node reported them in its answer's usage.",
            ["model", "node"],
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "qiip_completion_tokens",
            "Completion tokens, as the node reported them in its answer's usage.",
            ["model", "node"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "qiip_time_to_first_token_seconds",
            "Streaming requests: time from the request to its first data event reaching the client.",
            ["model", "node"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "qiip_request_duration_seconds",
            "Client requests: time from the request to the last byte of the response.",
            ["model", "node"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_TableCollector(table))
        self._recent_ttft_s: dict[str, deque[float]] = {}
        # The labelled series every answered request touches, looked up once per label set (prometheus-client's
        # `labels()` checks and locks on every call); label sets are bounded (the module docstring) and never removed.
        self._requests_by: dict[tuple[str, str, int], Any] = {}
        self._latency_by: dict[tuple[str, str], Any] = {}
        self._ttft_by: dict[tuple[str, str], Any] = {}
        self._prompt_by: dict[tuple[str, str], Any] = {}
        self._completion_by: dict[tuple[str, str], Any] = {}

    def snapshot(self) -> dict[str, Any]:
        """Counters as JSON, for the console and scripts: `{"by_model": {model: counts}, "by_node": {node:
        counts}}`. Every count is a total since the daemon started; rates are the growth between two reads.

        A model's and a node's counts: `requests` (client requests answered, by the node that answered),
        `errors` (those that failed, mid-stream cuts included; not those the client itself stopped,
        `client_disconnected`, which `qiip_request_errors_total` still counts), `retries` (attempts that failed on
        the node and went to another), `prompt_tokens` and `completion_tokens` (the nodes' `usage`). A node's also carry
        `failures` (its failed attempts, every kind of `qiip_upstream_errors_total`), `attempts` (requests it
        answered plus attempts that failed before an answer: `failures / attempts` is its error ratio) and,
        once it has served a stream, `ttft_p50_s` and `ttft_p95_s`: time to first token in seconds over its last
        `TTFT_WINDOW` streaming requests.
        """
        by_model: dict[str, dict[str, float]] = {}
        by_node: dict[str, dict[str, float]] = {}
        zero = {"requests": 0.0, "errors": 0.0, "retries": 0.0, "prompt_tokens": 0.0, "completion_tokens": 0.0}

        def add(labels: dict[str, str], key: str, value: float) -> None:
            for group, name in ((by_model, labels.get("model", "")), (by_node, labels.get("node", ""))):
                if name:
                    counts = group.setdefault(name, dict(zero))
                    counts[key] = counts.get(key, 0.0) + value

        counters = (
            (self.requests, "requests"),
            (self.errors, "errors"),
            (self.retries, "retries"),
            (self.prompt_tokens, "prompt_tokens"),
            (self.completion_tokens, "completion_tokens"),
        )
        for metric, key in counters:
            for labels, value in _totals(metric):
                if key == "errors" and labels.get("code") == "client_disconnected":
                    continue  # the client's choice (a stopped chat answer), not the model's failure
                add(labels, key, value)
        for labels, value in _totals(self.upstream_errors):
            node = labels.get("node", "")
            if node:
                counts = by_node.setdefault(node, dict(zero))
                counts["failures"] = counts.get("failures", 0.0) + value
                if labels.get("kind") != "truncated":
                    # A truncated answer was answered, so it is already among the requests.
                    counts["unanswered"] = counts.get("unanswered", 0.0) + value
        for counts in by_node.values():
            counts.setdefault("failures", 0.0)
            counts["attempts"] = counts["requests"] + counts.pop("unanswered", 0.0)
        for node, recent in self._recent_ttft_s.items():
            if recent and node in by_node:
                ordered = sorted(recent)
                by_node[node]["ttft_p50_s"] = statistics.median(ordered)
                by_node[node]["ttft_p95_s"] = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
        return {"by_model": by_model, "by_node": by_node}

    def decode_rate(self, model: str) -> tuple[float, int] | None:
        """How fast the fleet answered `model` since the daemon started: completion tokens its nodes reported over
        the seconds those requests took (prompt processing included: a conservative tokens/s of one sequence), and
        how many requests that is over; None before any request of it was answered with usage."""
        tokens = sum(v for labels, v in _totals(self.completion_tokens) if labels.get("model") == model)
        seconds = requests = 0.0
        for family in self.latency.collect():
            for sample in family.samples:
                if sample.labels.get("model") != model:
                    continue
                if sample.name.endswith("_sum"):
                    seconds += sample.value
                elif sample.name.endswith("_count"):
                    requests += sample.value
        if tokens <= 0 or seconds <= 0:
            return None
        return tokens / seconds, int(requests)

    def account(self, outcome: Outcome) -> None:
        """Record one finished client request (`summarize`, then `record`).

        Args:
            outcome: how the request ended; one without a status (the daemon stopped it before it had an
                answer) is not recorded.
        """
        accounted = summarize(outcome)
        if accounted is not None:
            self.record(accounted)

    def record(self, accounted: Accounted) -> None:
        """Record one finished client request: its count by status, its error, its failed attempts and
        failovers, the error that broke its answer, and (when a node answered) its latency, time to first
        token and the tokens of its usage.

        Args:
            accounted: the request, summarized here or by a worker process (`server.workers`).
        """
        model, node, status, error_code, duration_s, ttft_s, failures, relay_kind, usage = accounted
        key = (model, node, status)
        counted = self._requests_by.get(key)
        if counted is None:
            counted = self._requests_by[key] = self.requests.labels(model, node, str(status))
        counted.inc()
        if error_code is not None:
            self.errors.labels(model, node, error_code).inc()
        if failures:
            self._account_failures(model, node, failures)
        if relay_kind is not None:
            self.upstream_errors.labels(model, node, relay_kind).inc()
        if node:
            if self._on_finished is not None:
                self._on_finished(model, ttft_s)
            pair = (model, node)
            _series(self.latency, self._latency_by, pair).observe(duration_s)
            if usage is not None:
                _series(self.prompt_tokens, self._prompt_by, pair).inc(usage[0])
                _series(self.completion_tokens, self._completion_by, pair).inc(usage[1])
            if ttft_s is not None:
                _series(self.ttft, self._ttft_by, pair).observe(ttft_s)
                recent = self._recent_ttft_s.get(node)
                if recent is None:
                    recent = self._recent_ttft_s[node] = deque(maxlen=TTFT_WINDOW)
                recent.append(ttft_s)

    def counted(self) -> dict[CounterKey, float]:
        """The counters a worker keeps besides its requests (`add_counted`): shed requests, failed authentications,
        prefix-affinity results; each the total since the process started, by `CounterKey`."""
        found: dict[CounterKey, float] = {}
        for labels, value in _totals(self.shed):
            found["shed", labels["model"], labels["reason"]] = value
        for labels, value in _totals(self.auth_failures):
            found["auth_failures", labels["api"]] = value
        affinity = self._table.affinity
        if affinity is not None:
            for (model, result), count in list(affinity.results.items()):
                found["affinity", model, result] = count
        return found

    def add_counted(self, key: CounterKey, amount: float) -> None:
        """Add a worker's growth of one of its counters (a key of `counted`)."""
        match key:
            case ("shed", model, reason):
                self.shed.labels(model, reason).inc(amount)
            case ("auth_failures", api):
                self.auth_failures.labels(api).inc(amount)
            case ("affinity", model, result) if self._table.affinity is not None:
                results = self._table.affinity.results
                results[model, result] = results.get((model, result), 0) + int(amount)

    def _account_failures(self, model: str, node: str, failures: Sequence[tuple[str, str]]) -> None:
        # When no node answered, the last failure was not retried.
        retried = failures if node else failures[:-1]
        for failed_node, _ in retried:
            if failed_node:
                self.retries.labels(model, failed_node).inc()
        for failed_node, kind in failures:
            if failed_node:
                self.upstream_errors.labels(model, failed_node, kind).inc()
        # Every attempt after the first went to another node: the ones that failed, then the one that answered.
        tried = [failed_node for failed_node, _ in failures]
        if node:
            tried.append(node)
        for target in tried[1:]:
            if target:
                self.failover_attempts.labels(model, target).inc()
