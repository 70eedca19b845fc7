"""The settings of deployments (`[deployments]`) and the host pool (`[[hosts]]`).

The host entry models live here, below the deployments package, so that the settings can hold them; the
deployments package re-exports them (`qiip_core.deployments.HostSpec`).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from qiip_core.config._groups import PositiveSeconds, _Group

__all__ = ["DeploymentSettings", "GpuSpec", "HostSpec"]

_HOST_RE = re.compile(r"^(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?)*$")
_IPV4_RE = re.compile(r"^(25[0-5]|2[0-4]\d|1?\d?\d)(\.(25[0-5]|2[0-4]\d|1?\d?\d)){3}$")
_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")
_LABEL_VALUE_RE = re.compile(r"^[A-Za-z0-9._:/+-]{0,63}$")


class DeploymentSettings(_Group):
    """The deployment controller (`[deployments]`)."""

    enabled: bool = True
    """Run the controller in this gateway (with etcd, one gateway leads at a time)."""
    reconcile_interval_s: float = Field(default=2.0, gt=0, le=300)
    """Seconds between reconcile passes; an apply, scale, rollout or delete runs one at once."""
    leader_ttl_s: int = Field(default=10, ge=3, le=300)
    """With etcd: the controller's leader lease, in seconds; another gateway takes over within it after the
    leader dies."""
    replace_after_s: PositiveSeconds = 30.0
    """A replica unhealthy this long is replaced on another host, then torn down."""
    start_timeout_s: PositiveSeconds = 600.0
    """A registered replica not healthy after this long is replaced."""
    failure_backoff_s: PositiveSeconds = 60.0
    """A host where a replica failed is avoided this long, doubled per failure in a row (at most an hour)."""
    rollout_max_failures: int = Field(default=3, ge=1, le=100)
    """Replicas of one template that may fail before its rollout pauses (the old replicas keep serving)."""


def _host_name(value: Any) -> Any:
    if isinstance(value, str):
        value = value.strip().lower().rstrip(".")
        if not _HOST_RE.match(value) and not _IPV4_RE.match(value):
            raise ValueError("a host name is letters, digits, '-' and '.' (or an IPv4 address)")
    return value


class GpuSpec(BaseModel):
    """GPUs of one kind a host has, as an operator declares them: `{product, memory_mib, count}`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    product: str = Field(min_length=1, max_length=128)
    """The product name as NVML reports it (`NVIDIA A100-SXM4-80GB`)."""
    memory_mib: int = Field(ge=1, le=16_777_216)
    """Each GPU's total memory, in MiB."""
    count: int = Field(default=1, ge=1, le=64)
    """How many of them."""

    @field_validator("product")
    @classmethod
    def _printable(cls, value: str) -> str:
        if not value.isprintable():
            raise ValueError("product must be printable")
        return value


class HostSpec(BaseModel):
    """A host of the pool, as declared in `[[hosts]]` or added with `qiip host add`.

    TOML: `{name = "gpu01", labels = {rack = "b"}, gpus = [{product = "NVIDIA A100-SXM4-80GB", memory_mib = 81920,
    count = 8}], memory_mib = 1031000}`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """The host name or IPv4 address QIIP reaches it by over SSH (lowercase); its replica's node id."""
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    """Labels placements select on (`rack = "b"`)."""
    gpus: tuple[GpuSpec, ...] = Field(default=(), max_length=16)
    """Its GPUs, when known before a replica runs there (a live reading from its agent overrides them)."""
    memory_mib: int | None = Field(default=None, ge=1, le=1 << 30)
    """Its RAM in MiB: what a replica is planned against under the `cpu` provisioning profile."""

    _name = field_validator("name", mode="before")(classmethod(lambda cls, v: _host_name(v)))

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, text in value.items():
            if not _LABEL_KEY_RE.match(key):
                raise ValueError(f"label key {key!r} must be 1-63 letters, digits, '.', '_', '/' or '-'")
            if not _LABEL_VALUE_RE.match(text):
                raise ValueError(f"label {key}'s value {text!r} must be at most 63 letters, digits or . _ : / + -")
        return value

    @property
    def id(self) -> str:
        """The record's key: the host's name."""
        return self.name
