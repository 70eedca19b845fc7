"""Node selection settings (`[routing]`): failover, the endpoint allowlist, and the routing policy per model.

The policy names are `qiip_core.routing.RoutingPolicy`'s values; they are spelled here as strings because the
routing engine imports the settings, never the reverse.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated

from pydantic import Field, field_validator

from qiip_core.config._groups import PositiveSeconds, _Group
from qiip_core.nodes import DEFAULT_ALLOWED_HOSTS, DEFAULT_ALLOWED_NETWORKS, EndpointPolicy

__all__ = ["ROUTING_POLICIES", "RoutingSettings"]

ROUTING_POLICIES = ("least_connections", "prefix_affinity")
"""The routing policies (`qiip_core.routing.RoutingPolicy`)."""


class RoutingSettings(_Group):
    """Node selection, failover, the endpoint allowlist and the routing policy (`[routing]`)."""

    max_attempts: int = Field(default=3, ge=1, le=16)
    """Nodes tried per request, the first try included. 1 disables failover."""
    retry_after_timeout: bool = False
    """Send a request to another node after one that had received it timed out. Off by default: that node
    was working on it, so a re-send repeats the whole prompt's work elsewhere, and a request too big for the
    limits then loads every node in turn. Timeouts while connecting are always failed over."""
    allowed_endpoint_hosts: list[str] = Field(default_factory=lambda: list(DEFAULT_ALLOWED_HOSTS))
    """Host names a node endpoint may use: exact names or `*.suffix` patterns."""
    allowed_endpoint_networks: list[str] = Field(default_factory=lambda: list(DEFAULT_ALLOWED_NETWORKS))
    """CIDR networks an IP-literal node endpoint must fall in."""
    allowed_endpoint_ports: list[Annotated[int, Field(ge=1, le=65535)]] = Field(default_factory=list)
    """Ports a node endpoint may use; empty allows any port."""
    policy: str = "prefix_affinity"
    """How requests choose among a model's eligible nodes: `prefix_affinity` (the default, chosen from the
    measurement in docs/performance.md) sends a request to the node that served its longest known prompt
    prefix, which holds it in its KV cache, within `prefix_imbalance_requests`/`prefix_imbalance_ratio`, and
    falls back to least-connections; `least_connections` always picks the node with the fewest requests in
    flight."""
    model_policy: dict[str, str] = Field(default_factory=dict)
    """Per-model overrides of `policy`, by model id: a `[routing.model_policy]` table such as
    `"org/model:q4" = "least_connections"`."""
    prefix_imbalance_requests: int = Field(default=2, ge=0, le=10_000)
    """Prefix affinity yields to load: the affinity node is chosen only while its requests in flight exceed the
    least-loaded eligible node's by at most the larger of this count and `prefix_imbalance_ratio` × that
    node's (rounded down); otherwise least-connections decides."""
    prefix_imbalance_ratio: float = Field(default=0.25, ge=0, le=100)
    """See `prefix_imbalance_requests`: the allowed excess as a share of the least-loaded node's requests in
    flight, which matters on busy nodes (0.25: 25 % more)."""
    prefix_cache_entries: int = Field(default=50_000, ge=1, le=10_000_000)
    """The most prompt-prefix hashes remembered (about 200 bytes each; a conversation keeps about 8 to 10),
    the least recently used forgotten first."""
    prefix_ttl_s: PositiveSeconds = 600.0
    """Seconds a prefix is remembered after it was last routed: nodes evict their caches too."""

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        if value not in ROUTING_POLICIES:
            raise ValueError(f"{value!r} is not a routing policy; use one of {', '.join(ROUTING_POLICIES)}")
        return value

    @field_validator("model_policy")
    @classmethod
    def _model_policies(cls, value: dict[str, str]) -> dict[str, str]:
        for model, policy in value.items():
            if policy not in ROUTING_POLICIES:
                raise ValueError(
                    f"model {model!r} has {policy!r}, which is not a routing policy; use one of "
                    f"{', '.join(ROUTING_POLICIES)}"
                )
        return value

    @field_validator("allowed_endpoint_networks")
    @classmethod
    def _cidr(cls, value: list[str]) -> list[str]:
        for item in value:
            try:
                ipaddress.ip_network(item.strip(), strict=True)
            except ValueError:
                try:
                    network = ipaddress.ip_network(item.strip(), strict=False)
                except ValueError:
                    raise ValueError(f"{item!r} is not a CIDR network such as 10.0.0.0/8 or fd00::/8") from None
                raise ValueError(f"{item!r} has host bits set; did you mean {network}?") from None
        return value

    @field_validator("allowed_endpoint_hosts")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        for item in value:
            body = item[2:] if item.startswith("*.") else item
            if not body or "*" in body or "/" in body or ":" in body.strip("[]") and "." in body:
                raise ValueError(f"{item!r} is not a host name or a *.suffix pattern")
        return value

    def endpoint_policy(self) -> EndpointPolicy:
        """The allowlist these settings describe."""
        return EndpointPolicy.from_strings(
            hosts=self.allowed_endpoint_hosts,
            networks=self.allowed_endpoint_networks,
            ports=self.allowed_endpoint_ports,
        )
