"""What llmfit recommends for a host, as the console shows it: the table's rows, the hardware line, and the host a
node runs on.

The data is the daemon's `GET /admin/nodes/{host}/recommendations` (`qiip_core.recommendations.HostRecommendations`):
llmfit's ranking, normalised to QIIP's runtimes, each marked `in_catalog` when its repository (or one of its GGUF
repositories) is in the daemon's Hugging Face cache by exact name. Nothing here guesses a file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from qiip_core.client import NodeInfo
    from qiip_core.recommendations import HardwareSummary, HostRecommendations, Recommendation

__all__ = ["RECOMMENDATION_COLUMNS", "catalog_mark", "hardware_line", "host_of", "recommendation_rows"]

RECOMMENDATION_COLUMNS = ("#", "Model", "Runtime", "Fit", "tok/s", "Memory", "Quant", "Catalog")
"""The recommendations table's columns: rank, repository, runtime (vllm, llama_cpp, mlx, unknown), llmfit's fit
level, estimated tokens/s, memory required (GiB), best quantisation, and whether the catalog holds it."""

_RUNTIMES = {"vllm": "vLLM", "llama_cpp": "llama.cpp", "mlx": "MLX", "unknown": "unknown"}


def host_of(node: NodeInfo) -> str | None:
    """The host a node runs on: its endpoint's host name or address (`http://10.0.0.5:8000` → `10.0.0.5`); None
    for an endpoint without one."""
    return urlsplit(node.endpoint).hostname


def catalog_mark(recommendation: Recommendation) -> str:
    """`in catalog` when the recommended repository is in the catalog, `GGUF in catalog` when one of its GGUF
    repositories is, `no GGUF source` for a llama.cpp model with no GGUF to serve it from
    (`Recommendation.lacks_gguf`), else empty."""
    if recommendation.in_catalog:
        return "in catalog"
    if any(source.in_catalog for source in recommendation.gguf_sources):
        return "GGUF in catalog"
    if recommendation.lacks_gguf:
        return "no GGUF source"
    return ""


def recommendation_rows(found: HostRecommendations) -> list[tuple[str, ...]]:
    """One row per recommendation, best first, in `RECOMMENDATION_COLUMNS` order."""
    return [
        (
            str(r.rank),
            r.repo,
            _RUNTIMES.get(r.runtime, r.runtime_label),
            r.fit_level,
            f"{r.estimated_tokens_per_s:,.0f}" if r.estimated_tokens_per_s >= 10 else f"{r.estimated_tokens_per_s:.1f}",
            f"{r.memory_required_gib:.1f} GiB",
            r.quantization or "—",
            catalog_mark(r),
        )
        for r in found.recommendations
    ]


def hardware_line(found: HostRecommendations) -> str:
    """What llmfit scored against, in one line: the host or profile, CPU, memory and GPUs."""
    system: HardwareSummary = found.system
    parts = [f"Profile {found.profile}" if found.profile else f"Host {found.host}"]
    if system.cpu_name or system.cpu_cores:
        cores = f" ({system.cpu_cores} cores)" if system.cpu_cores else ""
        parts.append(f"{system.cpu_name or 'CPU'}{cores}")
    if system.total_ram_gib is not None:
        free = f"{system.available_ram_gib:.0f}/" if system.available_ram_gib is not None else ""
        parts.append(f"RAM {free}{system.total_ram_gib:.0f} GiB{' unified' if system.unified_memory else ''}")
    if system.gpu_count:
        vram = f", VRAM {system.gpu_vram_gib:.0f} GiB" if system.gpu_vram_gib is not None else ""
        parts.append(f"{system.gpu_count} × {system.gpu_name or 'GPU'}{vram}")
    else:
        parts.append("no GPU")
    return " · ".join(parts) + f" · llmfit {found.llmfit_version}"
