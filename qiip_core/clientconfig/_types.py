"""The vocabulary of client configs: which coding agent, how it gets its API key, the model's limits, and the
rendered file.

Pure values, no I/O: `_render` turns them into a file's text, `_limits` derives the limits from the fleet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from qiip_core.nodes import LlamaCppRuntime, NodeCapabilities

__all__ = [
    "DEFAULT_KEY_ENV",
    "PLACEHOLDER_KEY",
    "ApiKey",
    "ClientConfig",
    "ClientKind",
    "ModelLimits",
    "ServingNode",
]

DEFAULT_KEY_ENV = "QIIP_TOKEN"
"""The environment variable a generated config reads the invoke token from: the same one the console and the
`QiipClient` scripts read (`qiip_core.client.load_console_config`), and one the daemon's settings loader knows,
so exporting it for a coding agent never makes `qiip` refuse an unknown `QIIP_*` variable."""

PLACEHOLDER_KEY = "qiip-no-token-needed"
"""The key written when the endpoint needs none: Pi, OMP and the `openai` library refuse an empty key, and a
daemon without `auth.client_tokens = "required"` ignores whatever is sent."""

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ClientKind(StrEnum):
    """The coding agents a config can be generated for."""

    OPENCODE = "opencode"
    """OpenCode (`opencode.json`, an `@ai-sdk/openai-compatible` provider)."""
    PI = "pi"
    """The Pi coding agent (`~/.pi/agent/models.json`)."""
    OMP = "omp"
    """Oh My Pi, Pi's fork (`~/.omp/agent/models.yaml`)."""
    CONTINUE = "continue"
    """Continue (`~/.continue/config.yaml`)."""


@dataclass(frozen=True)
class ApiKey:
    """How a generated config gives its client the API key: by an environment variable, or as a literal.

    Build one with `ApiKey.from_env`, `ApiKey.literal` or `ApiKey.placeholder`; exactly one of the fields is set.

    Attributes:
        env_var: the variable the client reads the key from at run time (each client's own syntax).
        value: a key written into the file as it is.
    """

    env_var: str | None = None
    value: str | None = None

    def __post_init__(self) -> None:
        if (self.env_var is None) == (self.value is None):
            raise ValueError("An ApiKey names an environment variable or holds a value, exactly one of them.")
        if self.env_var is not None and not _ENV_NAME.match(self.env_var):
            raise ValueError(
                f"{self.env_var!r} is not an environment variable name: letters, digits and '_', not starting "
                "with a digit."
            )
        if self.value is not None and (not self.value.strip() or any(c in self.value for c in "\r\n")):
            raise ValueError("An API key must be one non-empty line.")

    @classmethod
    def from_env(cls, name: str = DEFAULT_KEY_ENV) -> ApiKey:
        """The key the client reads from the environment variable `name` when it runs.

        Raises:
            ValueError: `name` is not an environment variable name.
        """
        return cls(env_var=name)

    @classmethod
    def literal(cls, value: str) -> ApiKey:
        """A key written into the file as it is (only ever one the user gave).

        Raises:
            ValueError: it is empty or spans lines.
        """
        return cls(value=value)

    @classmethod
    def placeholder(cls) -> ApiKey:
        """`PLACEHOLDER_KEY`: for an endpoint that checks no key, since most clients refuse an empty one."""
        return cls(value=PLACEHOLDER_KEY)

    @classmethod
    def for_gateway(cls, *, tokens_required: bool, env_var: str = DEFAULT_KEY_ENV) -> ApiKey:
        """The default key of a config pointing at the gateway: the invoke token from `env_var` when the daemon
        requires one (`auth.client_tokens = "required"`), else the placeholder, so no secret is ever written.

        Raises:
            ValueError: `env_var` is not an environment variable name.
        """
        return cls.from_env(env_var) if tokens_required else cls.placeholder()


@dataclass(frozen=True)
class ModelLimits:
    """What a client may assume of the model behind the URL, in tokens; None where unknown (the client's own
    default applies then, and the field is left out of the file).

    Attributes:
        context_tokens: the context window a request may fill, prompt and answer together.
        max_output_tokens: the longest answer to ask for (`max_tokens`).
    """

    context_tokens: int | None = None
    max_output_tokens: int | None = None


@dataclass(frozen=True)
class ClientConfig:
    """A rendered config file.

    Attributes:
        client: the agent it is for.
        file_name: the name the agent looks for (`opencode.json`, `models.json`, `models.yaml`, `config.yaml`).
        text: the file's content (UTF-8 text, ending in a newline).
        media_type: `application/json` or `application/yaml` (RFC 9512).
        location: where the agent reads it, for messages (`~/.pi/agent/models.json`, …).
    """

    client: ClientKind
    file_name: str
    text: str
    media_type: str
    location: str


class ServingNode(Protocol):
    """A node as far as its limits go: the daemon's `Node` and the client's `NodeInfo` both are one."""

    @property
    def id(self) -> str: ...

    @property
    def endpoint(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def llamacpp_runtime(self) -> LlamaCppRuntime | None: ...

    @property
    def capabilities(self) -> NodeCapabilities: ...
