"""The settings of live GPU telemetry (`[telemetry]`): the `qiip agent` on each GPU node, and the daemon reading it.

One group serves both sides, so a node and its gateway agree on the interval and the key prefix from one config
file. With the etcd registry the agent writes its reading under `etcd.telemetry_prefix` with a lease of
`expire_after_intervals` intervals; with the embedded registry it serves the reading over HTTP (bearer token) and
the daemon polls the agents listed in `agents`.
"""

from __future__ import annotations

import math
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from qiip_core.config._groups import PositiveSeconds, _Group

__all__ = ["TelemetryAgentConfig", "TelemetrySettings"]


class TelemetryAgentConfig(_Group):
    """One agent the daemon polls with the embedded registry (`[[telemetry.agents]]`)."""

    node: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    """The node id the reading belongs to (the id the node is registered under)."""
    url: str
    """The agent's endpoint: `http://host:port` (the path `/v1/telemetry` is added)."""
    token_file: Path | None = None
    """A private file holding the agent's bearer token; None: `telemetry.token_file` or `telemetry.token`."""

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"{value!r} is not an agent URL such as http://gpu-01.example:9401")
        return value.rstrip("/")


class TelemetrySettings(_Group):
    """Live GPU telemetry (`[telemetry]`): what `qiip agent` reads and publishes, and how the daemon collects it."""

    interval_s: float = Field(default=5.0, gt=0, le=3600)
    """Seconds between two NVML readings of the agent, and between two polls of an agent by the daemon."""
    expire_after_intervals: int = Field(default=3, ge=2, le=100)
    """A reading is dropped after this many intervals without a newer one: the etcd lease of the agent's key
    (at least 2 s, etcd's shortest), and the age past which the daemon stops exporting it to Prometheus, counted in
    the interval the agent reports in each reading (or the daemon's poll interval when that is longer)."""
    node_id: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    """The node id the agent publishes under (`qiip agent --node-id`); None: the host's name."""
    listen_host: str = "127.0.0.1"
    """The address the agent's HTTP endpoint binds (embedded registry); `0.0.0.0` to let a gateway on another
    host poll it."""
    listen_port: int = Field(default=9401, ge=0, le=65535)
    """The port of the agent's HTTP endpoint (0: any free port, printed at start)."""
    token: SecretStr | None = None
    """The bearer token of the agent's HTTP endpoint; prefer `token_file`. Never logged."""
    token_file: Path | None = None
    """A private file (mode 0600) holding the bearer token of the agent's HTTP endpoint, on one line."""
    poll_timeout_s: PositiveSeconds = 2.0
    """Deadline of one poll of an agent by the daemon (connect and read), in seconds."""
    agents: list[TelemetryAgentConfig] = Field(default_factory=list)
    """The agents the daemon polls with the embedded registry (with etcd, it watches `etcd.telemetry_prefix`)."""

    @property
    def expiry_s(self) -> float:
        """Seconds after which a reading without a newer one is dropped (`expire_after_intervals` intervals)."""
        return self.expire_after_intervals * self.interval_s

    @property
    def lease_ttl_s(self) -> int:
        """The etcd lease of the agent's key, in whole seconds (at least 2, etcd's shortest lease)."""
        return max(2, math.ceil(self.expiry_s))

    @model_validator(mode="after")
    def _one_token(self) -> TelemetrySettings:
        if self.token is not None and self.token_file is not None:
            raise ValueError("give telemetry.token or telemetry.token_file, not both")
        names = [agent.node for agent in self.agents]
        duplicate = next((name for name in names if names.count(name) > 1), None)
        if duplicate is not None:
            raise ValueError(f"telemetry.agents lists node {duplicate!r} twice")
        return self
