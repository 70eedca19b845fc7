"""Which compute graph models which architecture, and whether a model's memory is modelled at all.

Each architecture llama.cpp builds its own graph for (`src/models/<arch>.cpp`); the planner rebuilds the ones
in `GRAPH_BUILDERS`, each checked against what a real llama-server logs (tests/core/planner). A model is
*modelled* when its architecture has a graph here and llama.cpp's memory rules for it are known (`_arch.py`);
`PythonEstimator` estimates only modelled models, and the planner hands every other to `llama-fit-params`.
"""

from __future__ import annotations

from collections.abc import Callable

from qiip_core.planner._graph import Graph, GraphParams
from qiip_core.planner._graph_embed import build_bert_graph
from qiip_core.planner._graph_gemma import build_gemma_graph
from qiip_core.planner._graph_llama import build_llama_graph
from qiip_core.planner._graph_moe import build_qwen_moe_graph
from qiip_core.planner._graph_recurrent import build_granite_hybrid_graph, build_lfm2_graph, build_mamba_graph
from qiip_core.planner._shape import ModelShape

__all__ = ["EXPERT_GRAPHS", "GRAPH_BUILDERS", "GraphBuilder", "build_graph", "is_modelled"]

GraphBuilder = Callable[[ModelShape, GraphParams], Graph]
"""Builds the reserved graph of one architecture."""

GRAPH_BUILDERS: dict[str, GraphBuilder] = {
    "llama": build_llama_graph,
    "gemma2": build_gemma_graph,
    "gemma3": build_gemma_graph,
    "qwen2moe": build_qwen_moe_graph,
    "qwen3moe": build_qwen_moe_graph,
    "lfm2": build_lfm2_graph,
    "granitehybrid": build_granite_hybrid_graph,
    "mamba": build_mamba_graph,
    "mamba2": build_mamba_graph,
    "qwen3": build_llama_graph,
    "bert": build_bert_graph,
    "nomic-bert": build_bert_graph,
}
"""`general.architecture` → the graph llama.cpp reserves for it."""

EXPERT_GRAPHS: frozenset[str] = frozenset({"llama", "qwen2moe", "qwen3moe"})
"""Architectures whose builder also models mixture-of-experts blocks (`<arch>.expert_count` > 0)."""


def is_modelled(shape: ModelShape) -> bool:
    """Whether `PythonEstimator` can estimate `shape`: its graph is rebuilt here and its memory rules are known.

    A model with experts (a Mixtral-style llama, say) is modelled only when its builder models expert blocks.
    """
    if shape.architecture not in GRAPH_BUILDERS or not shape.memory_known:
        return False
    return not shape.n_expert or shape.architecture in EXPERT_GRAPHS


def build_graph(shape: ModelShape, params: GraphParams) -> Graph:
    """The reserved graph of `shape` under `params`.

    Raises:
        ValueError: the architecture's graph is not modelled (`is_modelled` is False).
    """
    if not is_modelled(shape):
        raise ValueError(
            f"The compute graph of architecture {shape.architecture!r} is not modelled; estimate it with "
            "llama-fit-params."
        )
    return GRAPH_BUILDERS[shape.architecture](shape, params)
