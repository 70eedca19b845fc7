"""The groups of QIIP's settings: one pydantic model per TOML table (`[server]`, `[routing]`, `[etcd]`, …).

`Settings` (`_settings.py`) holds one of each and loads them; each group validates its own values, so an invalid
value is refused with the setting's name wherever it came from (the environment, `.env`, the TOML file, code).
The tables with a module of their own (`_routing`, `_provisioning`, `_nodes` for the declared nodes, …) build on
`_Group` and `PositiveSeconds` from here.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from qiip_core._errors import ConfigError

__all__ = [
    "AdminSettings",
    "AuthSettings",
    "BreakerSettings",
    "EngineSettings",
    "EtcdSettings",
    "HealthSettings",
    "LlamaCppEngineSettings",
    "LoggingSettings",
    "MiB",
    "PositiveSeconds",
    "RegistrySettings",
    "ServerSettings",
    "UpstreamSettings",
    "default_state_dir",
]

MiB = 1024 * 1024

PositiveSeconds = Annotated[float, Field(gt=0, le=86_400)]


def default_state_dir() -> Path:
    """The default state directory: `$XDG_STATE_HOME/qiip`, else `~/.local/state/qiip`."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "qiip"


def _default_engine_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "qiip" / "engines"


_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(?:[a-z0-9-]+(?:\.[a-z0-9-]+)*|\[[0-9a-f:.]+\])(?::[0-9]{1,5})?")
"""An origin as browsers serialise it (WHATWG URL, "origin"): lower-case scheme and host, optional port."""

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
"""Ports a browser leaves out of an origin, by scheme."""

_NOT_AN_ORIGIN = "is not * or an origin scheme://host[:port], such as https://app.example.com"
"""What is wrong with a `server.cors_allow_origins` entry that is no origin at all."""


_HOST_PATTERN = re.compile(r"(?:\*\.)?[a-z0-9_](?:[a-z0-9_-]{0,62})(?:\.[a-z0-9_](?:[a-z0-9_-]{0,62}))*")
"""A `server.allowed_hosts` entry: a DNS name, optionally `*.` before it (lower case, no port, no trailing dot)."""


def _origin_problem(text: str) -> str | None:
    """Why `text` is not an origin exactly as a browser sends it in `Origin`, or None.

    The CORS check compares origins as strings (Fetch standard, "CORS check"), so an origin written in another
    form than the browser's serialisation (RFC 6454 §6.2: lower-case scheme and host, no default port, no path)
    would never match: it is refused, with the form that would.
    """
    try:
        parts = urlsplit(text)
        host, port = parts.hostname, parts.port
        if host and ":" in host:
            host = f"[{ipaddress.IPv6Address(host).compressed}]"
    except ValueError:
        return _NOT_AN_ORIGIN
    if not parts.scheme or not host or "@" in parts.netloc:
        return _NOT_AN_ORIGIN
    scheme = parts.scheme.lower()
    form = f"{scheme}://{host}" + ("" if port is None or _DEFAULT_PORTS.get(scheme) == port else f":{port}")
    if not _ORIGIN.fullmatch(form):
        return _NOT_AN_ORIGIN
    if text != form:
        return f"is not written as a browser sends an origin (no path, lower case, no default port): use {form!r}"
    return None


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid")


MAX_WORKERS = 8
"""The most serving processes `server.workers` may ask for: past a few, one event loop per core gains little,
and each process keeps its own connections to every node."""


class ServerSettings(_Group):
    """Where the daemon listens (`[server]`)."""

    host: str = "127.0.0.1"
    """Address to bind. `qiip-proxy --host` overrides it."""
    port: int = Field(default=8080, ge=1, le=65535)
    """TCP port to bind. `qiip-proxy --port` overrides it."""
    shutdown_timeout_s: PositiveSeconds = 30.0
    """On SIGTERM, how long in-flight requests may run before they are cancelled."""
    max_body_bytes: int = Field(default=32 * MiB, ge=1024)
    """Largest client request body; a larger one gets 413 before it is read whole."""
    keep_alive_s: int = Field(default=75, ge=1, le=86_400)
    """Whole seconds an idle client connection stays open for its next request (uvicorn's
    `timeout_keep_alive`, whose own default is 5 s). Keep it above the idle timeout of the load balancer or
    proxy in front (AWS ALB: 60 s; Google Cloud's load balancers: 600 s, so 620 there): the balancer reuses
    an idle connection for that long, and one the daemon closed first fails its next request."""
    max_client_connections: int | None = Field(default=None, ge=1)
    """Client connections (idle keep-alive ones included) each serving process holds at once, counted as they are
    accepted: one more takes the place of the connection idle (or silent) longest, or, when every connection has a
    request in progress, is answered 503 and closed. None: derived at start from the open-file limit (raised to its
    hard limit where allowed), keeping room for connections to nodes and health probes, so clients can never
    take the file descriptors node traffic needs."""
    max_header_bytes: int = Field(default=64 * 1024, ge=4096, le=16 * MiB)
    """The longest request line and headers together; longer ones get 431 and the connection is closed."""
    header_timeout_s: PositiveSeconds = 30.0
    """How long a request's headers may take from its first byte (or from the connection's opening); then
    408 and the connection is closed."""
    body_timeout_s: PositiveSeconds = 300.0
    """How long a request's body may take once its headers are in; then 408 and the connection is closed."""
    max_connections_per_address: int = Field(default=256, ge=1)
    """Connections one client address may hold at once; its next one gets 503. Behind a load balancer or a
    proxy every client comes from its few addresses: raise this to its connection pool."""
    cors_allow_origins: list[str] = Field(default_factory=list)
    """Web origins whose pages may call the daemon from a browser (CORS): each `scheme://host[:port]` as the
    browser sends it in `Origin`, or `*` for any. Empty (the default): CORS is off, and a cross-origin page
    cannot read any answer."""
    workers: int | Literal["auto"] = "auto"
    """Serving processes behind the one port: `"auto"` (the default) is one per CPU core this process may run
    on, at most 8; 1 serves everything in one process; `N` adds `N - 1` worker processes that take client
    connections from the same listening socket and serve the client API, sharing one view of the fleet, one
    count of requests in flight per node (least-connections, concurrency caps, admission and drains stay
    global) and prefix affinity's map. The first process runs everything else (health checks, the registry, the
    admin API, which the workers pass on to it, and `/metrics`, which counts every worker's requests). `qiip up`
    runs 1 unless this is set."""
    forwarded_allow_ips: list[str] = Field(default_factory=list)
    """Addresses (or CIDR networks) of the proxies and load balancers whose `X-Forwarded-For` and
    `X-Forwarded-Proto` the daemon believes (uvicorn's `forwarded_allow_ips`, in every serving process). Empty
    (the default): no forwarded header is believed, and the client is the address that connected. A request
    from an address not listed keeps its own address whatever header it sends."""
    allowed_hosts: list[str] = Field(default_factory=list)
    """Host names clients may use to reach the daemon (the `Host` header), beyond the ones always allowed:
    `localhost` and `*.localhost`, any IP literal, and `host` itself. Each entry is an exact name, `*.suffix`,
    or `*` (any name: the check is off). Any other `Host` gets 421: a web page behind a DNS-rebinding name cannot
    use the daemon through the operator's browser."""
    chat_page: bool = True
    """Serve the browser chat playground at `/chat` (public like the client API; with `auth.client_tokens =
    "required"` the page asks for an invoke token). False: `/chat`, its assets and the client-config downloads
    (`/chat/config/{client}`) answer 404; `qiip client-config` works either way."""

    def worker_count(self) -> int:
        """The serving processes `workers` asks for: `"auto"` is one per usable CPU core, at most 8."""
        if self.workers == "auto":
            return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))
        return self.workers

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: object) -> object:
        if value == "auto":
            return value
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if type(value) is not int or not 1 <= value <= MAX_WORKERS:
            raise ValueError(f'must be a whole number from 1 to {MAX_WORKERS}, or "auto" (one per core); got {value!r}')
        return value

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _forwarded(cls, value: list[str]) -> list[str]:
        for item in value:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address or a CIDR network, such as 10.0.0.0/8") from None
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        checked = []
        for item in value:
            name = item.strip().lower().rstrip(".")
            if name != "*" and not _HOST_PATTERN.fullmatch(name):
                raise ValueError(f"{item!r} is not a host name, *.suffix or *, such as gateway.example.com")
            checked.append(name)
        return checked

    @field_validator("cors_allow_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        for item in value:
            if item != "*" and (problem := _origin_problem(item)):
                raise ValueError(f"{item!r} {problem}")
        return value


class UpstreamSettings(_Group):
    """How the gateway talks to nodes (`[upstream]`)."""

    connect_timeout_s: PositiveSeconds = 5.0
    """TCP (and TLS) connect timeout per attempt."""
    ttfb_timeout_s: PositiveSeconds = 120.0
    """Time to the first token of a stream: from sending the request to its first `data:` event (comments
    such as llama-server's `--sse-ping-interval` pings do not count). Long prompts on large models need a
    generous value."""
    generation_timeout_s: PositiveSeconds = 600.0
    """Time to a non-streaming answer: from sending the request to the whole answer. A node sends a
    non-streaming answer's headers only once generation has ended, so this bounds the whole generation."""
    request_deadline_s: PositiveSeconds = 3600.0
    """One deadline for the whole request: every attempt and the answer's relay together. A stream still
    running then ends with an error event."""
    idle_timeout_s: PositiveSeconds = 60.0
    """Longest silence between two chunks of a response once it has started."""
    write_timeout_s: PositiveSeconds = 30.0
    """Longest time to send the request body."""
    pool_timeout_s: PositiveSeconds = 10.0
    """Longest wait for a free connection in the pool."""
    max_connections: int = Field(default=1024, ge=1)
    """Connections open to all nodes together."""
    max_keepalive_connections: int = Field(default=256, ge=0)
    """Idle connections kept for reuse."""
    keepalive_expiry_s: PositiveSeconds = 4.0
    """Idle connections are closed after this; keep it below the nodes' own idle timeout (vLLM: 5 s)."""
    buffer_response_bytes: int = Field(default=1 * MiB, ge=0)
    """A non-streaming response up to this size is read whole before the client gets a byte, so a node
    that fails while sending it can still be failed over."""
    max_event_bytes: int = Field(default=16 * MiB, ge=64 * 1024)
    """Largest single SSE event held while waiting for its end; larger events are relayed in pieces."""


class AdminSettings(_Group):
    """The admin API (`[admin]`): HTTP Basic credentials for every `/admin/*` route."""

    enabled: bool = True
    """Serve `/admin/*`. When enabled, the daemon refuses to start without `username` and `password`."""
    username: str | None = Field(default=None, min_length=1, max_length=128)
    """Admin user name (`QIIP_ADMIN__USERNAME`)."""
    password: SecretStr | None = None
    """Admin password (`QIIP_ADMIN__PASSWORD`); never logged or shown."""
    drain_timeout_s: PositiveSeconds = 30.0
    """Default time a drain waits for in-flight requests before it reports what remained."""
    max_body_bytes: int = Field(default=64 * 1024, ge=1024)
    """The largest admin request body; larger ones get 413 before a byte of them is read."""
    max_restore_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, le=64 * 1024 * 1024)
    """The largest backup `POST /admin/state/restore` takes (at most the format's 64 MiB): an authenticated request's
    body, read only after its credentials are checked."""
    auth_failure_burst: int = Field(default=10, ge=1)
    """Wrong credentials a client address may present within `auth_failure_window_s`, counted apart for admin
    credentials and for invoke tokens (and for `qiip agent`'s bearer token); beyond, requests with that credential
    get 429 with `Retry-After`. A request without credentials never counts."""
    auth_failure_window_s: PositiveSeconds = 60.0
    """The window failed authentications are counted over, per client address."""

    def check_credentials(self) -> None:
        """Refuse an enabled admin API without credentials (the daemon calls this at start-up).

        Raises:
            ConfigError: enabled, and the user name or password is missing or empty.
        """
        if self.enabled and (not self.username or self.password is None or not self.password.get_secret_value()):
            raise ConfigError(
                "The admin API is enabled but has no credentials: set admin.username and admin.password "
                "(QIIP_ADMIN__USERNAME, QIIP_ADMIN__PASSWORD), or turn it off with admin.enabled = false."
            )


class HealthSettings(_Group):
    """Background health checks (`[health]`)."""

    interval_s: PositiveSeconds = 10.0
    """Time between probes of each node."""
    timeout_s: PositiveSeconds = 5.0
    """Timeout of one `GET /health` probe."""
    failure_threshold: int = Field(default=3, ge=1, le=100)
    """Consecutive failed probes that make a node `unhealthy`."""
    retry_interval_s: PositiveSeconds = 1.0
    """After a failed probe, the node is probed again this soon rather than at the next `interval_s`, so a
    node that hangs is found within about `failure_threshold` × (`timeout_s` + `retry_interval_s`)."""
    recovery_timeout_s: PositiveSeconds = 30.0
    """Timeout of the one-token completion probe that closes an open circuit breaker."""
    concurrency: int = Field(default=64, ge=1)
    """Probes in flight at once."""


class BreakerSettings(_Group):
    """Per-node circuit breakers (`[breaker]`; `qiip_core.routing.CircuitBreaker`)."""

    failure_threshold: int = Field(default=3, ge=1, le=100)
    """Failure signals (connect errors, timeouts, broken answers, 5xx) within `window_s` that open a node's
    breaker, together with `failure_rate`. Failures of requests that were in flight together are one signal."""
    failure_rate: float = Field(default=0.5, gt=0, le=1)
    """The share of the window's outcomes that must be failure signals to open the breaker."""
    window_s: PositiveSeconds = 10.0
    """The sliding window outcomes are counted over."""
    open_s: PositiveSeconds = 1.0
    """How long an open breaker waits before it lets one trial request through; doubles after each failed
    trial."""
    open_max_s: PositiveSeconds = 30.0
    """The longest an open breaker waits for its next trial."""

    @model_validator(mode="after")
    def _open_periods(self) -> BreakerSettings:
        if self.open_max_s < self.open_s:
            raise ValueError(f"open_max_s ({self.open_max_s:g}) must be at least open_s ({self.open_s:g})")
        return self


class LoggingSettings(_Group):
    """Logs (`[logging]`)."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    """Lowest level written."""
    format: Literal["console", "json"] = "console"
    """`json` for log collectors, `console` for people."""

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value


class RegistrySettings(_Group):
    """Where the fleet is recorded (`[registry]`)."""

    backend: Literal["embedded", "etcd"] = "embedded"
    """`embedded`: a state file under `state_dir` (one gateway); `etcd`: shared by every gateway (`[etcd]`)."""
    poll_interval_s: Annotated[float, Field(gt=0, le=60)] = 0.5
    """How often the embedded registry checks its state file for changes made by `qiip node …`, and the
    embedded token store its token file for tokens created or revoked by another process."""


class EtcdSettings(_Group):
    """The etcd cluster of the `etcd` registry backend (`[etcd]`)."""

    endpoints: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:2379"], min_length=1)
    """Client URLs of the etcd members (`http://host:port` or `https://host:port`); tried in turn."""
    prefix: str = "/nodes/"
    """Key prefix of node registrations: the key is `<prefix><node_id>`."""
    provisioning_prefix: str = "/provisioning/"
    """Key prefix of provisioning task records: `<provisioning_prefix><host>`."""
    tokens_prefix: str = "/tokens/"
    """Key prefix of invoke tokens (`registry.backend = "etcd"`): `<tokens_prefix><token_id>`."""
    telemetry_prefix: str = "/telemetry/"
    """Key prefix of live GPU readings `qiip agent` publishes: `<telemetry_prefix><node_id>`, under a lease."""
    deployments_prefix: str = "/deployments/"
    """Key prefix of deployments (`spec/<name>`), their statuses (`status/<name>`), the pool's added hosts
    (`hosts/<name>`) and the controller's leader lease (`leader`)."""
    lease_ttl_s: int = Field(default=600, gt=300, le=86_400)
    """Lease of a managed node's key; refreshed after each successful health probe of the node, so a node
    nobody can reach expires by itself. Must exceed 300 s and three health intervals."""
    timeout_s: PositiveSeconds = 5.0
    """Timeout of one etcd call (not of the watch, which stays open)."""
    reconnect_max_backoff_s: PositiveSeconds = 30.0
    """Longest wait between reconnection attempts while etcd is unreachable."""
    max_value_bytes: int = Field(default=256 * 1024, ge=1024)
    """A registration larger than this is skipped as hostile."""
    ca_file: Path | None = None
    """CA bundle to verify etcd's TLS certificate (https endpoints)."""
    cert_file: Path | None = None
    """Client certificate for TLS client authentication."""
    key_file: Path | None = None
    """Key of `cert_file`."""
    username: str | None = None
    """etcd user (etcd authentication); give `password` with it."""
    password: SecretStr | None = None
    """Password of `username`; never logged."""

    @field_validator("prefix", "provisioning_prefix", "tokens_prefix", "telemetry_prefix", "deployments_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value.startswith("/") or not value.endswith("/"):
            raise ValueError("a key prefix starts and ends with '/', such as /nodes/")
        return value

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
                raise ValueError(f"{url!r} is not an etcd client URL such as http://127.0.0.1:2379")
        return value

    @model_validator(mode="after")
    def _tokens_apart(self) -> EtcdSettings:
        # A token key under the node prefix would be read as a (malformed) registration, and the reverse.
        for name in ("prefix", "provisioning_prefix"):
            other: str = getattr(self, name)
            if self.tokens_prefix.startswith(other) or other.startswith(self.tokens_prefix):
                raise ValueError(
                    f"etcd.tokens_prefix ({self.tokens_prefix}) and etcd.{name} ({other}) overlap; "
                    "give invoke tokens a key prefix of their own, such as /tokens/"
                )
        return self

    @model_validator(mode="after")
    def _telemetry_apart(self) -> EtcdSettings:
        # A reading under another prefix would be read as a (malformed) registration, token or task.
        for name in ("prefix", "provisioning_prefix", "tokens_prefix"):
            other: str = getattr(self, name)
            if self.telemetry_prefix.startswith(other) or other.startswith(self.telemetry_prefix):
                raise ValueError(
                    f"etcd.telemetry_prefix ({self.telemetry_prefix}) and etcd.{name} ({other}) overlap; "
                    "give GPU readings a key prefix of their own, such as /telemetry/"
                )
        return self

    @model_validator(mode="after")
    def _deployments_apart(self) -> EtcdSettings:
        # A deployment record under another prefix would be read as a (malformed) registration, token or task.
        for name in ("prefix", "provisioning_prefix", "tokens_prefix", "telemetry_prefix"):
            other: str = getattr(self, name)
            if self.deployments_prefix.startswith(other) or other.startswith(self.deployments_prefix):
                raise ValueError(
                    f"etcd.deployments_prefix ({self.deployments_prefix}) and etcd.{name} ({other}) overlap; "
                    "give deployments a key prefix of their own, such as /deployments/"
                )
        return self

    @model_validator(mode="after")
    def _pairs(self) -> EtcdSettings:
        if (self.username is None) != (self.password is None):
            raise ValueError("etcd.username and etcd.password go together: give both or neither")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("etcd.cert_file and etcd.key_file go together: give both or neither")
        return self


class AuthSettings(_Group):
    """Invoke tokens: the credentials clients present to the OpenAI-compatible API (`[auth]`)."""

    client_tokens: Literal["off", "required"] = "off"
    """`required`: every client request needs `Authorization: Bearer <secret>` of a live invoke token;
    `off`: clients present nothing. Tokens live where `registry.backend` says (state file or etcd)."""
    token_default_ttl_s: int = Field(default=3600, gt=0)
    """Lifetime in seconds of a token created without a ttl (one hour)."""
    token_max_ttl_s: int = Field(default=30 * 86_400, gt=0, le=3650 * 86_400)
    """Longest lifetime in seconds a token may be created with (30 days); longer requests are refused."""

    @model_validator(mode="after")
    def _default_within_max(self) -> AuthSettings:
        if self.token_default_ttl_s > self.token_max_ttl_s:
            raise ValueError(
                f"auth.token_default_ttl_s ({self.token_default_ttl_s}) exceeds auth.token_max_ttl_s "
                f"({self.token_max_ttl_s}); lower the default or raise the maximum"
            )
        return self


class LlamaCppEngineSettings(_Group):
    """The pinned llama.cpp source and where builds go (`[engines.llamacpp]`)."""

    source_kind: Literal["pypi-sdist", "llama.cpp"] = "pypi-sdist"
    """`pypi-sdist`: llama-cpp-python's source distribution, which carries llama.cpp in
    `vendor/llama.cpp`; `llama.cpp`: a llama.cpp release archive."""
    version: str = "0.3.36"
    """The llama-cpp-python version (`pypi-sdist`) or the llama.cpp tag such as `b6500` (`llama.cpp`)."""
    sha256: str | None = None
    """SHA-256 of the source archive. Required whenever `version` is not the pinned default."""
    url_template: str | None = None
    """Archive URL with `{version}`. Default: resolved from `index_url` (`pypi-sdist`), or the llama.cpp
    GitHub tag archive (`llama.cpp`)."""
    index_url: str = "https://pypi.org/simple"
    """The package index used to find the sdist (`pypi-sdist` without `url_template`)."""
    install_dir: Path = Field(default_factory=lambda: _default_engine_dir() / "llama.cpp")
    """Builds go to `<install_dir>/<version>-<variant>/bin`, with a `current` link to the newest."""
    server_binary: Path | None = None
    """Use this `llama-server` instead of the installed one."""
    cuda_architectures: str | None = Field(
        default=None, pattern=r"^(native|[0-9]{2,3}[af]?(-real|-virtual)?(;[0-9]{2,3}[af]?(-real|-virtual)?)*)$"
    )
    """The CUDA architectures a CUDA build compiles for (`CMAKE_CUDA_ARCHITECTURES`: `90`, `80;90`, or `native` for
    the GPUs of the building host). None: llama.cpp's portable list (every GPU generation, a much longer build)."""

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: str | None) -> str | None:
        if value is not None:
            value = value.strip().lower()
            if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
                raise ValueError("sha256 must be 64 hexadecimal characters")
        return value


class EngineSettings(_Group):
    """Inference engines (`[engines]`)."""

    llamacpp: LlamaCppEngineSettings = Field(default_factory=LlamaCppEngineSettings)
