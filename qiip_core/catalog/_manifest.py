"""Model manifests: a revision described by its publisher's digests, registered before any byte is fetched.

```json
{"name": "Project assistant", "revision": "immutable-source-commit", "source": "publisher/model",
 "licence": "Apache-2.0", "format": "gguf", "quantization": "Q4_K_M", "entrypoint": "model.gguf",
 "capabilities": ["chat"],
 "files": [{"name": "model.gguf", "digest": "sha256:<64 hex>", "bytes": 123456789,
            "url": "https://huggingface.co/publisher/model/resolve/COMMIT/model.gguf"}]}
```

Files live in a flat snapshot under their original names; `url` is optional (a file can be uploaded from local
disk instead). A URL must be HTTPS on an allowed host with no credentials in it. A registered revision is
immutable: its id is the SHA-256 of the canonical manifest, and another manifest for the same source and revision
is refused rather than allowed to replace it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qiip_core._errors import ManifestInvalid, SourceNotAllowed
from qiip_core._violation import Violation
from qiip_core.catalog._types import artifact_id

__all__ = ["Manifest", "ManifestFile", "check_source_url", "host_allowed", "parse_manifest"]

_NAME = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,254}$"
"""A flat file name: no directories, not hidden, no `..`."""


class ManifestFile(BaseModel):
    """One file of a revision."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=_NAME)
    """Its original name, flat."""
    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    """`sha256:` and the publisher's 64-hex SHA-256."""
    bytes: int = Field(ge=0, le=2**50)
    """Its exact size in bytes."""
    url: str | None = Field(default=None, max_length=4096)
    """Where to acquire it over HTTPS; absent for a file uploaded from local disk."""

    @property
    def sha256(self) -> str:
        """The digest's 64 hex characters."""
        return self.digest.removeprefix("sha256:")


class Manifest(BaseModel):
    """A model revision: provenance, licence, format, entrypoint, capabilities and every file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=200)
    revision: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    """The immutable source revision (a commit), never a moving branch."""
    source: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
    """`publisher/model`."""
    licence: str = Field(min_length=1, max_length=100)
    format: Literal["gguf", "safetensors"]
    quantization: str | None = Field(default=None, max_length=40)
    entrypoint: str = Field(pattern=_NAME)
    capabilities: tuple[Literal["chat", "completions", "embeddings"], ...] = ("chat",)
    files: tuple[ManifestFile, ...] = Field(min_length=1, max_length=4096)

    @property
    def id(self) -> str:
        """`rev_` + the first 24 hex of the SHA-256 of the canonical manifest (sorted keys, no whitespace)."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return "rev_" + hashlib.sha256(canonical.encode()).hexdigest()[:24]

    @property
    def artifact_id(self) -> str:
        """The identity of its files, computed as the catalog computes a generation's (`artifact_id`)."""
        return artifact_id(
            repo_id=self.source, revision=self.revision, files=[f.name for f in self.files], entrypoint=self.entrypoint
        )

    @property
    def size_bytes(self) -> int:
        """Bytes of every file."""
        return sum(f.bytes for f in self.files)


def host_allowed(host: str, allowed: list[str]) -> bool:
    """Whether `host` matches an entry of `allowed` (exact names, or `*.suffix` for any sub-domain)."""
    host = host.lower().rstrip(".")
    for entry in allowed:
        if entry.startswith("*.") and host.endswith(entry[1:]):
            return True
        if host == entry:
            return True
    return False


def check_source_url(url: str, allowed: list[str]) -> str:
    """Refuse a URL an acquisition may not fetch (the first one, and every redirect).

    Args:
        url: the URL.
        allowed: `models.allowed_download_hosts`.

    Returns:
        The URL.

    Raises:
        SourceNotAllowed: not HTTPS, credentials in it, or a host outside `allowed`.
    """
    parts = urlsplit(url)
    if parts.scheme != "https":
        raise SourceNotAllowed(f"{_shown(url)} is not an HTTPS URL; acquisitions use HTTPS only.")
    if parts.username is not None or parts.password is not None:
        raise SourceNotAllowed("A source URL carries credentials; give a URL without user:password@.")
    if not parts.hostname or not host_allowed(parts.hostname, allowed):
        raise SourceNotAllowed(
            f"{parts.hostname or url!r} is not an allowed download host; add it to models.allowed_download_hosts "
            "if it should be."
        )
    return url


def _shown(url: str) -> str:
    """A URL without its query (signed URLs carry secrets there)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{parts.path}"


def parse_manifest(data: Any, *, allowed_hosts: list[str]) -> Manifest:
    """Validate a manifest (a parsed JSON object) and its rules across fields.

    Args:
        data: the manifest as JSON data.
        allowed_hosts: `models.allowed_download_hosts`, which every file URL must match.

    Returns:
        The manifest.

    Raises:
        ManifestInvalid: a field is malformed, a file name repeats, the entrypoint is not one of the files, or a
            URL is not allowed; `.violations` lists each (field, message).
    """
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        violations = [
            Violation(".".join(str(p) for p in error["loc"]) or "manifest", str(error["msg"])) for error in exc.errors()
        ]
        raise ManifestInvalid(_summary(violations), violations=violations) from None
    violations = []
    names = [f.name for f in manifest.files]
    for name in sorted({n for n in names if names.count(n) > 1}):
        violations.append(Violation("files", f"the file name {name!r} appears more than once"))
    if manifest.entrypoint not in names:
        violations.append(Violation("entrypoint", f"{manifest.entrypoint!r} is not one of the files"))
    if manifest.format == "gguf" and not manifest.entrypoint.endswith(".gguf"):
        violations.append(Violation("entrypoint", "a gguf revision's entrypoint is a .gguf file"))
    for index, file in enumerate(manifest.files):
        if file.url is not None:
            try:
                check_source_url(file.url, allowed_hosts)
            except SourceNotAllowed as exc:
                violations.append(Violation(f"files.{index}.url", exc.message))
    if violations:
        raise ManifestInvalid(_summary(violations), violations=violations)
    return manifest


def _summary(violations: list[Violation]) -> str:
    first = violations[0]
    more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
    return f"The manifest is invalid: {first.field}: {first.message}{more}."
