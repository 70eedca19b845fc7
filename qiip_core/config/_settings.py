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
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from qiip_core._errors import ConfigError
from qiip_core.config._admission import AdmissionSettings, ModelAdmission
from qiip_core.config._deployments import DeploymentSettings, GpuSpec, HostSpec
from qiip_core.config._groups import (
    AdminSettings,
    AuthSettings,
    BreakerSettings,
    EngineSettings,
    EtcdSettings,
    HealthSettings,
    LlamaCppEngineSettings,
    LoggingSettings,
    RegistrySettings,
    ServerSettings,
    UpstreamSettings,
    default_state_dir,
)
from qiip_core.config._models import ModelSettings
from qiip_core.config._nodes import AttachedProfile, LocalNodeConfig, NodeConfig
from qiip_core.config._provisioning import ProvisioningSettings
from qiip_core.config._quads import QuadsSettings
from qiip_core.config._redfish import RedfishSettings
from qiip_core.config._routing import RoutingSettings
from qiip_core.config._telemetry import TelemetryAgentConfig, TelemetrySettings
from qiip_core.nodes import check_settings_url

__all__ = [
    "AdminSettings",
    "AdmissionSettings",
    "AttachedProfile",
    "AuthSettings",
    "BreakerSettings",
    "DeploymentSettings",
    "EtcdSettings",
    "GpuSpec",
    "HealthSettings",
    "HostSpec",
    "LOCAL_NODE_PLAN_VARIABLE",
    "LlamaCppEngineSettings",
    "LocalNodeConfig",
    "LoggingSettings",
    "ModelAdmission",
    "ModelSettings",
    "NodeConfig",
    "ProvisioningSettings",
    "QuadsSettings",
    "RedfishSettings",
    "RegistrySettings",
    "RoutingSettings",
    "ServerSettings",
    "Settings",
    "TelemetryAgentConfig",
    "TelemetrySettings",
    "UpstreamSettings",
    "default_state_dir",
    "format_validation_error",
    "load_settings",
]

LOCAL_NODE_PLAN_VARIABLE = "QIIP_LOCAL_NODE_PLAN"
"""The variable `qiip up` hands the daemon it starts its planned local nodes in (a versioned JSON record,
`qiip_core.engines.llamacpp.LocalNodeHandoff`); not a setting."""

_NOT_SETTINGS = frozenset({"QIIP_CONFIG", "QIIP_URL", "QIIP_TOKEN", "QIIP_CONSOLE_CONFIG", LOCAL_NODE_PLAN_VARIABLE})
"""`QIIP_` variables that are not settings: the config file of the CLI, the daemon URL of the console, the local
nodes `qiip up` hands the daemon."""

_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("qiip_config_file", default=None)


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
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    breaker: BreakerSettings = Field(default_factory=BreakerSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    etcd: EtcdSettings = Field(default_factory=EtcdSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    engines: EngineSettings = Field(default_factory=EngineSettings)
    models: ModelSettings = Field(default_factory=ModelSettings)
    provisioning: ProvisioningSettings = Field(default_factory=ProvisioningSettings)
    redfish: RedfishSettings = Field(default_factory=RedfishSettings)
    quads: QuadsSettings = Field(default_factory=QuadsSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    deployments: DeploymentSettings = Field(default_factory=DeploymentSettings)
    nodes: list[NodeConfig] = Field(default_factory=list)
    """Nodes declared in the config file."""
    local_nodes: list[LocalNodeConfig] = Field(default_factory=list)
    """llama.cpp nodes this daemon launches itself."""
    attached: list[AttachedProfile] = Field(default_factory=list)
    """Approved existing OpenAI-compatible servers that may be attached as nodes."""
    hosts: list[HostSpec] = Field(default_factory=list)
    """The host pool deployments may place replicas on (besides `qiip host add` and QUADS-lent hosts)."""

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

    def connected_urls(self) -> list[tuple[str, str]]:
        """`(setting, url)` of every URL QIIP connects to from its settings, in the settings' order: each
        `[[attached]]` url, `quads.url`, `models.hub_endpoint` and `redfish.bmc_url_template` (a template), where
        set. The one list the address rule is applied to (`qiip_core.nodes.check_settings_url` when the settings
        load, `qiip_core.config.check_settings_names` when the daemon starts)."""
        urls: list[tuple[str, str | None]] = [
            (f"attached[{i}].url ({profile.name})", profile.url) for i, profile in enumerate(self.attached)
        ]
        urls += [("quads.url", self.quads.url), ("models.hub_endpoint", self.models.hub_endpoint)]
        urls.append(("redfish.bmc_url_template", self.redfish.bmc_url_template))
        return [(setting, url) for setting, url in urls if url is not None]

    @model_validator(mode="after")
    def _reachable_urls(self) -> Settings:
        # One rule for every URL QIIP connects to from its settings (`qiip_core.nodes.check_settings_url`).
        networks = self.routing.endpoint_policy().networks
        for setting, url in self.connected_urls():
            check_settings_url(url, setting=setting, networks=networks)
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
        except RecursionError:
            raise ConfigError(
                f"The config file {config_file} nests arrays or tables too deeply to read; no setting needs that."
            ) from None
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
    except RecursionError:
        raise ConfigError(_too_deep()) from None
    finally:
        _config_file.reset(token)


def _too_deep() -> str:
    """Name the variables whose JSON nests too deeply for Python's decoder (which raises RecursionError)."""
    names = []
    for key, value in sorted(os.environ.items()):
        if not key.startswith("QIIP_") or key in _NOT_SETTINGS:
            continue
        try:
            json.loads(value)
        except RecursionError:
            names.append(key)
        except ValueError:
            pass
    where = ", ".join(names) if names else "a variable (in the environment or .env)"
    return (
        f"A setting could not be parsed: {where} nests JSON arrays or objects too deeply to read; no setting needs "
        "that, so fix its value."
    )


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
