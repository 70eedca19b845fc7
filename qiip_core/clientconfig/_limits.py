"""Where a config points, and what the model behind it can take: the gateway (load-balanced over every node of
the model) or one node, with the context window and the longest answer from the nodes' verified runtimes.

The context window is a llama.cpp node's `context_per_slot` (`llamacpp_runtime.effective`, verified against
the running llama-server): the tokens each slot is guaranteed when every slot is busy. A slot may use more when
the others are idle (`slot_context_limit`), but an agent that plans its prompts for that fails under load; it
compacts its history by this number instead. vLLM nodes carry no such record, so theirs is unknown.

The longest answer is a quarter of the window, at most 8,192 tokens (`OUTPUT_SHARE`, `MAX_OUTPUT_TOKENS`):
coding agents send long prompts (files, tool results) and stop well short of that, and an answer that may take
the whole window would leave the prompt no room. A node's `capabilities.max_tokens`, the largest `max_tokens`
it accepts, caps it further.

Through the gateway, a request may land on any healthy node of the model, so each limit is the smallest over
them, and unknown when one of them does not know it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from qiip_core._errors import ModelNotFound, NodeNotFound
from qiip_core.clientconfig._render import openai_base_url, render_client_config
from qiip_core.clientconfig._types import ApiKey, ClientConfig, ClientKind, ModelLimits, ServingNode

__all__ = [
    "MAX_OUTPUT_TOKENS",
    "OUTPUT_SHARE",
    "Target",
    "gateway_limits",
    "node_limits",
    "render_target",
    "resolve_target",
]

OUTPUT_SHARE = 4
"""The longest answer is at most 1/`OUTPUT_SHARE` of the context window."""

MAX_OUTPUT_TOKENS = 8192
"""…and at most this many tokens."""


@dataclass(frozen=True)
class Target:
    """Where a client config points.

    Attributes:
        base_url: the OpenAI base URL, ending in `/v1`.
        model: the model id.
        limits: what the model behind it can take.
        node_id: the node, for a config that bypasses the gateway; None for the gateway.
        provider_id: the provider's key in the file: `qiip`, or `qiip-<node>`.
        provider_name: its display name: `QIIP`, or `QIIP node <node>`.
    """

    base_url: str
    model: str
    limits: ModelLimits
    node_id: str | None = None

    @property
    def provider_id(self) -> str:
        return "qiip" if self.node_id is None else f"qiip-{self.node_id}"

    @property
    def provider_name(self) -> str:
        return "QIIP" if self.node_id is None else f"QIIP node {self.node_id}"


def node_limits(node: ServingNode) -> ModelLimits:
    """What one node can take, from its verified llama.cpp runtime and its capabilities (see the module)."""
    context: int | None = None
    runtime = node.llamacpp_runtime
    if runtime is not None:
        value = runtime.effective.get("context_per_slot")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            context = value
    cap = node.capabilities.max_tokens
    if context is None:
        return ModelLimits(context_tokens=None, max_output_tokens=cap)
    output = max(1, min(context // OUTPUT_SHARE, MAX_OUTPUT_TOKENS))
    return ModelLimits(context_tokens=context, max_output_tokens=min(output, cap) if cap is not None else output)


def gateway_limits(nodes: Iterable[ServingNode], model: str) -> ModelLimits:
    """What `model` can take through the gateway: each limit the smallest over its healthy nodes (all its nodes
    when none is healthy now), unknown when one of them does not know it or no node serves the model."""
    serving = [n for n in nodes if n.model == model]
    healthy = [n for n in serving if n.status == "healthy"]
    each = [node_limits(n) for n in (healthy or serving)]
    contexts = [limits.context_tokens for limits in each]
    outputs = [limits.max_output_tokens for limits in each]
    return ModelLimits(context_tokens=_smallest(contexts), max_output_tokens=_smallest(outputs))


def _smallest(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known and len(known) == len(values) else None


def resolve_target(nodes: Sequence[ServingNode], *, model: str, gateway_url: str, node_id: str | None = None) -> Target:
    """Where a config for `model` points: the gateway at `gateway_url`, or the node `node_id` directly.

    Args:
        nodes: every node of the fleet (the daemon's table, or `GET /admin/nodes`).
        model: the model id asked for.
        gateway_url: the daemon's URL as the client reaches it (`/v1` is appended).
        node_id: a node to point at instead of the gateway; it must serve `model`.

    Returns:
        The base URL and limits.

    Raises:
        ModelNotFound: no node serves `model` (the message names the models served), or `node_id` serves
            another model.
        NodeNotFound: no node has the id `node_id` (the message names the nodes).
        ValueError: `gateway_url`, or the node's endpoint, is not an http(s) URL.
    """
    served = sorted({n.model for n in nodes})
    if model not in served:
        listing = f"the models served: {', '.join(served)}" if served else "no node serves any model yet"
        raise ModelNotFound(f"No node serves the model {model!r}; {listing}.", model=model)
    if node_id is None:
        return Target(base_url=openai_base_url(gateway_url), model=model, limits=gateway_limits(nodes, model))
    node = next((n for n in nodes if n.id == node_id), None)
    if node is None:
        error = NodeNotFound(node_id)
        mine = sorted(n.id for n in nodes if n.model == model)
        error.message = f"No node has the id {node_id!r}; the nodes serving {model!r}: {', '.join(mine)}."
        error.args = (error.message,)
        raise error
    if node.model != model:
        raise ModelNotFound(f"The node {node_id} serves {node.model!r}, not {model!r}.", model=model)
    return Target(base_url=openai_base_url(node.endpoint), model=model, limits=node_limits(node), node_id=node_id)


def render_target(target: Target, client: ClientKind, api_key: ApiKey) -> ClientConfig:
    """`render_client_config` for a `resolve_target` answer: its URL, model, limits and provider names.

    Raises:
        ValueError: see `render_client_config`.
    """
    return render_client_config(
        client,
        base_url=target.base_url,
        model=target.model,
        api_key=api_key,
        limits=target.limits,
        provider_id=target.provider_id,
        provider_name=target.provider_name,
    )
