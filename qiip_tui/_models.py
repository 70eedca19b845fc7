"""What the models screen shows, computed from the daemon's answers without a terminal (tested fast).

`catalog_rows` turns `GET /admin/models/catalog` into the generations table's rows, `catalog_summary` into the
line above it (with the degraded badge's text), and `download_line` turns one download of
`GET /admin/models/downloads` into the label beside its progress bar.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["GENERATION_COLUMNS", "catalog_rows", "catalog_summary", "download_line", "size_text"]

GENERATION_COLUMNS = ("Artifact", "Repository", "Revision", "Entrypoint", "Arch", "Quant", "Context", "Size", "Nodes")
"""The generations table's columns."""


def size_text(n_bytes: int | None) -> str:
    """Bytes as the console writes them: `241.4 MiB`, `3.1 GiB`, `812 B`; `?` when unknown."""
    if n_bytes is None:
        return "?"
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover - the loop returns


def catalog_rows(catalog: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...]]]:
    """One `(artifact_id, cells)` per GGUF generation, in the daemon's order."""
    rows: list[tuple[str, tuple[str, ...]]] = []
    for g in catalog.get("gguf", []):
        flags = ("" if g.get("modelled", True) else " *") + ("" if g.get("verifiable", True) else " !")
        rows.append(
            (
                str(g["artifact_id"]),
                (
                    str(g["artifact_id"])[:12],
                    str(g["repo_id"]),
                    str(g["revision"])[:12] + (f" ({', '.join(g['refs'])})" if g.get("refs") else ""),
                    str(g["entrypoint"]) + flags,
                    str(g.get("architecture") or "?"),
                    str(g.get("quantization") or "?"),
                    f"{int(g.get('context_length') or 0):,}",
                    size_text(g.get("size_bytes")),
                    ", ".join(g.get("nodes", [])) or "-",
                ),
            )
        )
    return rows


def catalog_summary(catalog: Mapping[str, Any]) -> tuple[str, bool]:
    """The line above the table, and whether the scan is degraded (the screen shows it as a badge)."""
    counters = catalog.get("counters", {})
    issues = ", ".join(f"{n} {kind}" for kind, n in counters.items() if n) or "no issues"
    text = (
        f"{len(catalog.get('gguf', []))} GGUF generation(s), {len(catalog.get('full', []))} full model(s) "
        f"in {catalog.get('cache_dir', '?')}; {issues}.  * sized by llama-fit-params  ! unverifiable"
    )
    degraded = bool(catalog.get("degraded"))
    if degraded:
        text = "DEGRADED: part of the cache could not be read, the lists may be short. " + text
    return text, degraded


def download_line(download: Mapping[str, Any]) -> str:
    """`org/model@main  running  120.0 MiB of 241.4 MiB  52.0 MiB/s  ETA 2 s` (or the error)."""
    head = f"{download['repo_id']}@{download['revision']}  {download['state']}"
    if download.get("error"):
        return f"{head}  {download['error']}"
    done = size_text(download.get("bytes_done"))
    total = size_text(download.get("bytes_total"))
    rate = download.get("rate_bytes_per_s") or 0
    eta = download.get("eta_s")
    tail = f"  {size_text(int(rate))}/s" if rate else ""
    tail += f"  ETA {eta:.0f} s" if eta and download["state"] == "running" else ""
    return f"{head}  {done} of {total}{tail}"
