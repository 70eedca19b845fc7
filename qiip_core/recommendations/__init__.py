"""Recommendations: what a host can run well, as llmfit scores its model database against the host's hardware.

```
Recommender(settings, check_host=…, known_hosts=…).recommend(host, profile=…, limit=…, catalog_repos=…)
    → HostRecommendations {host, profile, llmfit_version, system: HardwareSummary,
                           recommendations: [Recommendation {rank, repo, runtime, fit_level, score,
                                             estimated_tokens_per_s, memory_required_gib, quantization,
                                             gguf_sources: [GgufSource], in_catalog, …}]}
LlmfitBinary.from_environment()     the pinned llmfit of the gateway's environment, its digest the wheel's
install_llmfit(ssh, binary)         on the host over SFTP: reused when its SHA-256 matches, else replaced atomically
parse_recommendations(stdout, …)    llmfit `recommend --json` → HostRecommendations (pure)
catalog_repos(catalog)              the repository ids `in_catalog` is matched against
```
"""

from __future__ import annotations

from qiip_core.recommendations._install import LlmfitBinary, install_llmfit, remote_llmfit_dir
from qiip_core.recommendations._recommender import (
    DEFAULT_LIMIT,
    MAX_LIMIT,
    MAX_OUTPUT_BYTES,
    PROFILE_PATTERN,
    Recommender,
    catalog_repos,
)
from qiip_core.recommendations._types import (
    LLMFIT_VERSION,
    FitLevel,
    GgufSource,
    HardwareSummary,
    HostRecommendations,
    Recommendation,
    Runtime,
    parse_recommendations,
)

__all__ = [
    "DEFAULT_LIMIT",
    "LLMFIT_VERSION",
    "MAX_LIMIT",
    "MAX_OUTPUT_BYTES",
    "PROFILE_PATTERN",
    "FitLevel",
    "GgufSource",
    "HardwareSummary",
    "HostRecommendations",
    "LlmfitBinary",
    "Recommendation",
    "Recommender",
    "Runtime",
    "catalog_repos",
    "install_llmfit",
    "parse_recommendations",
    "remote_llmfit_dir",
]
