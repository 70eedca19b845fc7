"""Which nodes serve a model, for the confirmations of actions that take a node out of service.

Pure. A node serves its model's clients only while it is `healthy` (`qiip_core.nodes.NodeStatus`) and its
circuit breaker is not open (an open breaker keeps requests away until its trial): draining, removing or
relaunching the last such node of a model leaves that model's clients with errors until another node serves
it, and the confirmation says so before the operator agrees.
"""

from __future__ import annotations

from collections.abc import Iterable

from qiip_core.client import NodeInfo
from qiip_core.nodes import NodeStatus

__all__ = ["last_healthy_warning", "unserved_models_warning"]


def _serving(node: NodeInfo) -> bool:
    return node.status == NodeStatus.HEALTHY and node.breaker.state != "open"


def last_healthy_warning(node: NodeInfo, nodes: Iterable[NodeInfo]) -> str | None:
    """The warning for taking `node` out of service, when it is the last healthy node of its model.

    Args:
        node: the node the action takes out of service.
        nodes: every node of the fleet (`node` among them or not).

    Returns:
        One sentence naming the node and the model, or None when the node is not healthy or another node
        serves the same model (healthy, its breaker not open).
    """
    if node.status != NodeStatus.HEALTHY:
        return None
    others = (n for n in nodes if n.id != node.id and n.model == node.model and _serving(n))
    if any(True for _ in others):
        return None
    return (
        f"{node.id} is the last healthy node of {node.model}: clients of that model will get 503 until another "
        "node serves it."
    )


def unserved_models_warning(taken: Iterable[NodeInfo], nodes: Iterable[NodeInfo]) -> str | None:
    """The warning for taking several nodes out of service at once, naming each model they leave without a healthy
    node.

    Args:
        taken: the nodes the action takes out of service.
        nodes: every node of the fleet.

    Returns:
        One sentence, or None when every model of `taken` keeps a node that serves it (healthy, its breaker not
        open) or lost none that did.
    """
    taken = list(taken)
    ids = {node.id for node in taken}
    serving_before = {node.model for node in taken if _serving(node)}
    still_served = {node.model for node in nodes if node.id not in ids and _serving(node)}
    left = sorted(serving_before - still_served)
    if not left:
        return None
    which = "that model" if len(left) == 1 else "those models"
    return (
        f"No healthy node would be left for {', '.join(left)}: clients of {which} will get 503 until another node "
        "serves it."
    )
