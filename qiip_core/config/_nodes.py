"""The nodes the config file declares: served elsewhere (`[[nodes]]`), attached OpenAI-compatible servers
(`[[attached]]`), and llama.cpp nodes the daemon launches on its own host (`[[local_nodes]]`).

Each entry is checked here as it is read (its id, an attached server's URL, the one model file a local node
names); a `[[nodes]]` endpoint is checked against the allowlist, which needs `[routing]`, when the registry reads
it at start-up (`qiip_core.discovery`).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from qiip_core.config._groups import PositiveSeconds, _Group
from qiip_core.nodes import Engine, ModelName, NodeCapabilities

__all__ = ["AttachedProfile", "LocalNodeConfig", "NodeConfig"]


class NodeConfig(_Group):
    """A node declared in the config file (`[[nodes]]`)."""

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    """Stable node name."""
    endpoint: str
    """`scheme://host:port`, checked against the allowlist."""
    model: str = Field(min_length=1, max_length=512)
    """The served model alias, matched exactly."""
    engine: Engine = Engine.VLLM
    """`vllm`, `llama_cpp` or `attached`."""
    capabilities: NodeCapabilities = Field(default_factory=NodeCapabilities)
    """What the node serves."""


class AttachedProfile(_Group):
    """An administrator-approved OpenAI-compatible server that may be attached as a node (`[[attached]]`).

    HTTPS with normal certificate checks; plain HTTP only to a numeric loopback address. Redirects are never
    followed and proxy environment variables never apply.
    """

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    """The node id it is attached as."""
    url: str
    """`https://host[:port]` (or `http://127.0.0.1:port` / `http://[::1]:port`), without a path."""
    model: str = Field(min_length=1, max_length=512)
    """The model clients ask for; the server must list it in its `/v1/models`."""
    capabilities: NodeCapabilities = Field(default_factory=NodeCapabilities)
    """The APIs it serves (`endpoints`)."""
    concurrency: int = Field(default=8, ge=1, le=10_000)
    """At most this many requests in flight to it."""
    deadline_s: PositiveSeconds = 300.0
    """Longest a request to it may take, start to end."""
    token_file: Path | None = None
    """A file holding the bearer token the server expects; must be a regular file only its owner can read.
    Its content is never shown."""
    attach_on_start: bool = True
    """Attach it when the daemon starts (otherwise `POST /admin/attached/{name}` does)."""

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        parts = urlsplit(value.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("the url must be https://host[:port]")
        if parts.path not in ("", "/") or parts.query or parts.fragment or "@" in parts.netloc:
            raise ValueError("the url takes no path, query, fragment or credentials: https://host[:port]")
        if parts.scheme == "http":
            try:
                loopback = ipaddress.ip_address(parts.hostname).is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                raise ValueError("plain http is allowed only to a numeric loopback address; use https")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return f"{parts.scheme}://{host}:{port}"


class LocalNodeConfig(_Group):
    """A llama.cpp node the daemon launches and supervises on its own host (`[[local_nodes]]`)."""

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    """Node name."""
    gguf: Path | None = None
    """The GGUF file (or the first shard of a split family) to serve; or give `artifact_id`."""
    artifact_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{8,64}$")
    """A GGUF generation to serve (`qiip model list`: the Hugging Face cache, or an acquired manifest revision),
    instead of `gguf`: its id, or its first 8 or more characters when they name one id only."""
    model: ModelName
    """The alias clients use as `model`: printable, with no surrounding whitespace (as a node's `model`)."""
    host: str = "127.0.0.1"
    """Address llama-server binds."""
    port: int = Field(default=0, ge=0, le=65535)
    """llama-server's port; 0 picks a free one."""
    slots: int | None = Field(default=None, ge=1, le=256)
    """Parallel slots (`--parallel`) when `sizing` is not given; unset, the default local sizing
    (`qiip_core.engines.llamacpp.default_local_policy`: 2 slots). Each slot gets min(training context, 4096)
    tokens with an F16 K/V cache."""
    sizing: dict[str, Any] | None = None
    """A llama.cpp sizing policy, as in a relaunch: `{sizing = "auto", fit_target_mib = 512}` lets the planner
    maximise context and slots; `{sizing = "custom", context_per_slot, slots, cache_type, fit_target_mib}`
    asks for exact values. Overrides `slots`."""
    embeddings: bool = False
    """Serve `/v1/embeddings` (`--embeddings`) instead of generation. An embedding model (one whose GGUF
    declares a pooling, or an encoder such as BERT) is always served so."""
    threads: int = Field(default=0, ge=0)
    """CPU threads (`--threads`); 0 lets llama.cpp choose."""
    startup_timeout_s: PositiveSeconds = 300.0
    """How long loading may take before the launch counts as failed."""

    @model_validator(mode="after")
    def _one_model(self) -> LocalNodeConfig:
        if (self.gguf is None) == (self.artifact_id is None):
            raise ValueError(
                f"local node {self.id!r} needs exactly one of gguf (a file) and artifact_id (a catalog entry)"
            )
        return self
