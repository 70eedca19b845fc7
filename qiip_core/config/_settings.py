"""QIIP's settings: one model for the daemon, the CLI and the console.

Values come from, highest priority first: arguments given in code (the CLI's flags), environment
variables (`QIIP_` prefix, `__` between nested names: `QIIP_ROUTING__MAX_ATTEMPTS=2`), a `.env` file in
the working directory, the TOML file given with `--config`, and the defaults below. Every setting is
listed in `.env.example`.

An invalid value stops start-up with a `ConfigError` naming the setting, its environment variable and
what is allowed; an unknown key in the TOML file is an error too, so a typo never silently does nothing.
"""

from __future__ import annotations

import contextvars
import ipaddress
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from qiip_core._errors import ConfigError
from qiip_core.nodes import (
    DEFAULT_ALLOWED_HOSTS,
    DEFAULT_ALLOWED_NETWORKS,
    EndpointPolicy,
    Engine,
    NodeCapabilities,
)

__all__ = [
    "AdminSettings",
    "AttachedProfile",
    "AuthSettings",
    "BreakerSettings",
    "EtcdSettings",
    "HealthSettings",
    "LlamaCppEngineSettings",
    "LocalNodeConfig",
    "LoggingSettings",
    "NodeConfig",
    "RegistrySettings",
    "RoutingSettings",
    "ServerSettings",
    "Settings",
    "UpstreamSettings",
    "default_state_dir",
    "format_validation_error",
    "load_settings",
]

MiB = 1024 * 1024

PositiveSeconds = Annotated[float, Field(gt=0, le=86_400)]

_NOT_SETTINGS = frozenset({"QIIP_CONFIG", "QIIP_URL", "QIIP_TOKEN", "QIIP_CONSOLE_CONFIG"})
"""`QIIP_` variables that are not settings: the config file of the CLI, the daemon URL of the console."""

_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("qiip_config_file", default=None)


def default_state_dir() -> Path:
    """The default state directory: `$XDG_STATE_HOME/qiip`, else `~/.local/state/qiip`."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "qiip"


def _default_engine_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "qiip" / "engines"


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class RoutingSettings(_Group):
    """Node selection, failover and the endpoint allowlist (`[routing]`)."""

    max_attempts: int = Field(default=3, ge=1, le=16)
    """Nodes tried per request, the first try included. 1 disables failover."""
    allowed_endpoint_hosts: list[str] = Field(default_factory=lambda: list(DEFAULT_ALLOWED_HOSTS))
    """Host names a node endpoint may use: exact names or `*.suffix` patterns."""
    allowed_endpoint_networks: list[str] = Field(default_factory=lambda: list(DEFAULT_ALLOWED_NETWORKS))
    """CIDR networks an IP-literal node endpoint must fall in."""
    allowed_endpoint_ports: list[Annotated[int, Field(ge=1, le=65535)]] = Field(default_factory=list)
    """Ports a node endpoint may use; empty allows any port."""

    @field_validator("allowed_endpoint_networks")
    @classmethod
    def _cidr(cls, value: list[str]) -> list[str]:
        for item in value:
            try:
                ipaddress.ip_network(item.strip(), strict=True)
            except ValueError:
                try:
                    network = ipaddress.ip_network(item.strip(), strict=False)
                except ValueError:
                    raise ValueError(f"{item!r} is not a CIDR network such as 10.0.0.0/8 or fd00::/8") from None
                raise ValueError(f"{item!r} has host bits set; did you mean {network}?") from None
        return value

    @field_validator("allowed_endpoint_hosts")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        for item in value:
            body = item[2:] if item.startswith("*.") else item
            if not body or "*" in body or "/" in body or ":" in body.strip("[]") and "." in body:
                raise ValueError(f"{item!r} is not a host name or a *.suffix pattern")
        return value

    def endpoint_policy(self) -> EndpointPolicy:
        """The allowlist these settings describe."""
        return EndpointPolicy.from_strings(
            hosts=self.allowed_endpoint_hosts,
            networks=self.allowed_endpoint_networks,
            ports=self.allowed_endpoint_ports,
        )


class UpstreamSettings(_Group):
    """How the gateway talks to nodes (`[upstream]`)."""

    connect_timeout_s: PositiveSeconds = 5.0
    """TCP (and TLS) connect timeout per attempt."""
    ttfb_timeout_s: PositiveSeconds = 120.0
    """Time to first byte: from sending the request to the response headers and, when streaming, the
    first event. Long prompts on large models need a generous value."""
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
    recovery_timeout_s: PositiveSeconds = 30.0
    """Timeout of the one-token completion probe that closes an open circuit breaker."""
    concurrency: int = Field(default=64, ge=1)
    """Probes in flight at once."""


class BreakerSettings(_Group):
    """Per-node circuit breakers (`[breaker]`)."""

    failure_threshold: int = Field(default=3, ge=1, le=100)
    """Consecutive request failures (connect errors, timeouts, 5xx) that open a node's breaker."""


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

    @field_validator("prefix", "provisioning_prefix", "tokens_prefix")
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
    gguf: Path
    """The GGUF file (or the first shard of a split family) to serve."""
    model: str = Field(min_length=1, max_length=512)
    """The alias clients use as `model`."""
    host: str = "127.0.0.1"
    """Address llama-server binds."""
    port: int = Field(default=0, ge=0, le=65535)
    """llama-server's port; 0 picks a free one."""
    slots: int = Field(default=2, ge=1, le=256)
    """Parallel slots (`--parallel`) when `sizing` is not given: each slot gets min(training context, 4096)
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


class Settings(BaseSettings):
    """All of QIIP's settings. Load them with `load_settings`."""

    model_config = SettingsConfigDict(
        env_prefix="QIIP_",
        env_nested_delimiter="__",
        env_file=".env",
        extra="forbid",
        validate_default=True,
    )

    state_dir: Path = Field(default_factory=default_state_dir)
    """Directory for the embedded registry's state file and other local state (`QIIP_STATE_DIR`)."""
    server: ServerSettings = Field(default_factory=ServerSettings)
    admin: AdminSettings = Field(default_factory=AdminSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    breaker: BreakerSettings = Field(default_factory=BreakerSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    etcd: EtcdSettings = Field(default_factory=EtcdSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    engines: EngineSettings = Field(default_factory=EngineSettings)
    nodes: list[NodeConfig] = Field(default_factory=list)
    """Nodes declared in the config file."""
    local_nodes: list[LocalNodeConfig] = Field(default_factory=list)
    """llama.cpp nodes this daemon launches itself."""
    attached: list[AttachedProfile] = Field(default_factory=list)
    """Approved existing OpenAI-compatible servers that may be attached as nodes."""

    @field_validator("state_dir", mode="before")
    @classmethod
    def _absolute_state_dir(cls, value: object) -> object:
        if isinstance(value, str | Path):
            text = str(value).strip()
            if not text:
                raise ValueError("state_dir is empty; give an absolute directory such as /var/lib/qiip")
            path = Path(text).expanduser()
            if not path.is_absolute():
                raise ValueError(
                    f"state_dir {text!r} is relative; give an absolute directory so the daemon and the CLI "
                    "always use the same one"
                )
            return path
        return value

    @model_validator(mode="after")
    def _lease_outlives_probes(self) -> Settings:
        if self.registry.backend == "etcd" and self.etcd.lease_ttl_s <= 3 * self.health.interval_s:
            raise ValueError(
                f"etcd.lease_ttl_s ({self.etcd.lease_ttl_s}) must exceed three health intervals "
                f"(3 x health.interval_s = {3 * self.health.interval_s:g} s), or healthy nodes would expire"
            )
        return self

    @model_validator(mode="after")
    def _unique_ids(self) -> Settings:
        seen: set[str] = set()
        for node_id in [n.id for n in self.nodes] + [n.id for n in self.local_nodes] + [a.name for a in self.attached]:
            if node_id in seen:
                raise ValueError(f"node id {node_id!r} is declared twice in nodes/local_nodes/attached")
            seen.add(node_id)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [
            init_settings,
            env_settings,
            _DotEnvWithoutClientVariables(dotenv_settings),
        ]
        path = _config_file.get()
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)


class _DotEnvWithoutClientVariables(PydanticBaseSettingsSource):
    """The `.env` source, without the client-side variables (`QIIP_URL`, `QIIP_TOKEN`, …) that a `.env` shared
    with the console or the CLI may hold: they are not daemon settings, and the settings forbid unknown keys."""

    def __init__(self, inner: PydanticBaseSettingsSource) -> None:
        super().__init__(inner.settings_cls)
        self._inner = inner

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._inner.get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        return {key: value for key, value in self._inner().items() if key.upper() not in _NOT_SETTINGS}


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Load the settings from the environment, `.env`, an optional TOML file and overrides.

    Args:
        config_file: a TOML file (`--config`); None reads no file.
        **overrides: values that beat every other source, nested as dicts (`server={"port": 9000}`).

    Returns:
        The validated settings.

    Raises:
        ConfigError: the file is missing or not valid TOML, or a value is invalid; the message names each
            invalid setting, its environment variable and what is allowed.
    """
    if config_file is not None:
        if not config_file.is_file():
            raise ConfigError(f"The config file {config_file} does not exist or is not a regular file.")
        try:
            with config_file.open("rb") as f:
                tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"The config file {config_file} is not valid TOML: {exc}.") from exc
        except OSError as exc:
            raise ConfigError(f"The config file {config_file} cannot be read: {exc.strerror}.") from exc
    unknown = sorted(
        key
        for key in os.environ
        if key.startswith("QIIP_")
        and key[5:].split("__")[0].lower() not in Settings.model_fields
        and key not in _NOT_SETTINGS
    )
    if unknown:
        raise ConfigError(
            f"Unknown setting{'s' if len(unknown) > 1 else ''} in the environment: {', '.join(unknown)}; "
            "check the spelling against .env.example."
        )
    token = _config_file.set(config_file)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, config_file)) from exc
    except SettingsError as exc:
        raise ConfigError(_unparsable(exc)) from exc
    finally:
        _config_file.reset(token)


def _unparsable(exc: SettingsError) -> str:
    """Name the variables behind a value pydantic-settings could not decode (a list or table not in JSON)."""
    match = re.search(r'field "(\w+)"', str(exc))
    group = match.group(1) if match else ""
    names = sorted(key for key in os.environ if group and key.upper().startswith(f"QIIP_{group.upper()}__"))
    where = ", ".join(names) if names else f"a QIIP_{group.upper()}__… variable" if group else "a variable"
    return (
        f"A setting could not be parsed: {where} (in the environment or .env). Lists and tables are written in "
        "JSON there, like QIIP_ROUTING__ALLOWED_ENDPOINT_PORTS='[8001, 8002]'."
    )


def _sentence(text: str) -> str:
    return text if text.endswith((".", "?", "!")) else text + "."


def format_validation_error(exc: ValidationError, config_file: Path | None) -> str:
    """Turn a settings `ValidationError` into lines naming each setting, its variable and the problem."""
    from_env = any(
        "QIIP_" + "__".join(str(p).upper() for p in error["loc"] if not str(p).isdigit()) in os.environ
        for error in exc.errors()
    )
    where = f" in {config_file}" if config_file and not from_env else ""
    lines = [f"Invalid settings{where}:"]
    for error in exc.errors():
        loc = [str(part) for part in error["loc"]]
        dotted = ".".join(loc)
        env = "QIIP_" + "__".join(p.upper() for p in loc if not p.isdigit())
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            lines.append(f"- {dotted}: unknown setting; check its spelling against .env.example.")
            continue
        if not loc or error["type"] == "value_error" and isinstance(error.get("input"), dict):
            # A rule across several settings: its message names them.
            lines.append(f"- {dotted + ': ' if loc else ''}{_sentence(message)}")
            continue
        got = error.get("input")
        shown = (
            "" if isinstance(got, dict | list) or got is None or error["type"] == "value_error" else f" (got {got!r})"
        )
        lines.append(f"- {dotted} ({env}): {_sentence(message + shown)}")
    return "\n".join(lines)
