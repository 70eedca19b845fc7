"""Models: the Hugging Face cache catalog, GGUF generations and their `artifact_id`.

```
scan_catalog(cache_dir) -> Catalog          huggingface_hub's scan_cache_dir, grouped into
 ├── gguf: [GgufGeneration]                 standalone GGUFs and complete split families (shard 1 the entrypoint)
 ├── full: [FullModel]                      complete safetensors snapshots (vLLM)
 └── issues: [CatalogIssue]                 incomplete, unverifiable, invalid, corrupted (→ degraded)
artifact_id(repo_id=…, revision=…, files=…, entrypoint=…)   SHA-256 of a canonical JSON
```
"""

from __future__ import annotations

from qiip_core.catalog._acquire import ObjectStore, Transfer
from qiip_core.catalog._download import (
    Download,
    DownloadManager,
    DownloadState,
    check_file_name,
    check_revision,
    discard_partial,
    download_files,
    sweep_incomplete,
)
from qiip_core.catalog._files import sha256_of
from qiip_core.catalog._manifest import Manifest, ManifestFile, check_source_url, host_allowed, parse_manifest
from qiip_core.catalog._scan import default_cache_dir, resolve_artifact, scan_catalog, verify_generation
from qiip_core.catalog._store import (
    AcquisitionState,
    ModelStore,
    RevisionStatus,
    artifact_entrypoint,
    model_store_for,
    resolve_artifact_id,
)
from qiip_core.catalog._types import (
    ARTIFACT_ID_RE,
    ARTIFACT_PREFIX_RE,
    Catalog,
    CatalogIssue,
    FullModel,
    GgufGeneration,
    IssueKind,
    artifact_id,
    match_artifact_id,
)

__all__ = [
    "ARTIFACT_ID_RE",
    "ARTIFACT_PREFIX_RE",
    "AcquisitionState",
    "Catalog",
    "CatalogIssue",
    "Download",
    "DownloadManager",
    "DownloadState",
    "FullModel",
    "GgufGeneration",
    "IssueKind",
    "Manifest",
    "ManifestFile",
    "ModelStore",
    "ObjectStore",
    "RevisionStatus",
    "Transfer",
    "artifact_entrypoint",
    "artifact_id",
    "check_file_name",
    "check_revision",
    "check_source_url",
    "default_cache_dir",
    "discard_partial",
    "download_files",
    "host_allowed",
    "match_artifact_id",
    "model_store_for",
    "parse_manifest",
    "resolve_artifact",
    "resolve_artifact_id",
    "scan_catalog",
    "sha256_of",
    "sweep_incomplete",
    "verify_generation",
]
