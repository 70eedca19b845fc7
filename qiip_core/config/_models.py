"""The `[models]` settings: the Hugging Face cache, the hub, and verified acquisitions."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator

from qiip_core.config._groups import MiB, _Group

__all__ = ["DEFAULT_DOWNLOAD_HOSTS", "ModelSettings"]


DEFAULT_DOWNLOAD_HOSTS = (
    "huggingface.co",
    "cdn-lfs.hf.co",
    "cdn-lfs-us-1.hf.co",
    "cdn-lfs-eu-1.hf.co",
    "cas-bridge.xethub.hf.co",
    "cas-server.xethub.hf.co",
    "transfer.xethub.hf.co",
)
"""Hosts a manifest's files may be acquired from by default: the Hugging Face Hub, its LFS CDN and its Xet
storage (US and EU), as its download documentation lists them."""


class ModelSettings(_Group):
    """The Hugging Face cache nodes load from, the hub downloads come from, and verified acquisitions (`[models]`)."""

    hf_cache_dir: Path | None = None
    """The Hugging Face hub cache (`models--ORG--NAME/…`). Default: huggingface_hub's own (`HF_HUB_CACHE`, else
    `$HF_HOME/hub`, else `~/.cache/huggingface/hub`)."""
    hub_endpoint: str | None = None
    """The hub's base URL. Default: huggingface_hub's own (`HF_ENDPOINT`, else `https://huggingface.co`)."""
    hub_token: SecretStr | None = None
    """A hub access token for gated or private repositories; never logged or shown."""
    store_dir: Path | None = None
    """Where registered manifests, partial acquisitions and verified objects live. Default:
    `<state_dir>/models/store`."""
    allowed_download_hosts: list[str] = Field(default_factory=lambda: list(DEFAULT_DOWNLOAD_HOSTS))
    """Hosts an acquisition may fetch from, redirects included: exact names or `*.suffix` patterns. The list
    replaces the default; include every host the chosen source redirects to."""
    ca_bundle: Path | None = None
    """A PEM file of certificate authorities to trust for acquisitions instead of the system's."""
    chunk_bytes: int = Field(default=16 * MiB, ge=64 * 1024, le=256 * MiB)
    """Bytes written (and made durable) per step of an acquisition (16 MiB)."""

    @field_validator("hub_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
            raise ValueError("hub_endpoint must be an http(s) URL without credentials, such as https://huggingface.co")
        return value.rstrip("/")

    @field_validator("allowed_download_hosts")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        cleaned = []
        for host in value:
            name = host.strip().lower()
            bare = name.removeprefix("*.")
            if not bare or any(c in bare for c in "/:@ *"):
                raise ValueError(f"{host!r} is not a host name or *.suffix pattern")
            cleaned.append(name)
        return cleaned
