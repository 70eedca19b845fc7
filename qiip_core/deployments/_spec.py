"""The Deployment resource as an operator writes it, and the one rule set that checks it.

A deployment declares a model the fleet serves and how many replicas of it to keep; QIIP places each replica on a
host of the pool that the planner proves it fits, provisions it, and keeps it (see `qiip_core.deployments`).

```toml
name = "coder"                          # the model name clients send (`model` in the OpenAI request)
engine = "llama_cpp"                    # or "vllm"
replicas = 3

[source]                                # exactly one of:
artifact = "4f1c2b8e"                   #   a GGUF generation of the shared model cache: its id, or a unique
                                        #   prefix of at least 8 hex characters
# hub = { repo = "org/name", file = "model-q4_k_m.gguf", revision = "main" }
                                        #   a file of a hub repository (llama.cpp) or the repository (vLLM);
                                        #   the revision is resolved to its commit when the deployment is applied

[runtime]                               # llama.cpp; at most one of:
sizing = { sizing = "auto" }            #   the planner's automatic sizing (the default), or a custom sizing
# capacity = { sequences = 4, context_tokens = 8192 }   at least this many sequences of this many tokens each

[placement]                             # every rule must hold for a host to be chosen
hosts = ["gpu*"]                        # host name patterns (fnmatch); empty: every host of the pool
labels = { rack = "b" }                 # labels the host must carry, with these values
gpu_product = "*A100*"                  # a pattern every GPU's product name must match
min_gpu_memory_mib = 40960              # each GPU's total memory, at least
quads_free_for_s = 86400                # QUADS must leave the host alone this long (default: quads.lookahead_s)

[update]
max_surge = 1                           # replicas above `replicas` while a rollout runs
max_unavailable = 0                     # replicas below `replicas` it may take away
```

The models type-check only (strict, no unknown keys); `parse_spec` turns every problem into a `Violation` with
its dotted field, so the admin API, the CLI and the console word refusals the same way. What needs the daemon's
knowledge (does the artifact exist, what is the hub's commit) is checked when the deployment is applied.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qiip_core._errors import DeploymentInvalid, PlanError
from qiip_core._violation import Violation
from qiip_core.engines.ollama import check_ollama_name
from qiip_core.nodes import PROVISIONED_ENGINE_CHOICES, Engine, ProvisionedEngine, ollama_model_key
from qiip_core.planner import MAX_SLOTS, AutoPolicy, CustomPolicy, parse_policy

__all__ = [
    "DEPLOYMENT_NAME_RE",
    "Autoscale",
    "Capacity",
    "DeploymentSpec",
    "HubSource",
    "Placement",
    "Runtime",
    "Source",
    "UpdateStrategy",
    "parse_spec",
]

DEPLOYMENT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
"""A deployment's name: the model name clients send, 1–128 characters, no spaces or control characters."""

_HEX_PREFIX_RE = re.compile(r"^[0-9a-f]{8,64}$")
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_REVISION_RE = re.compile(r"^(?!.*\.\.)(?!/)(?!.*//)[A-Za-z0-9._/-]{1,128}(?<!/)$")
_FILE_RE = re.compile(r"^(?!/)(?!.*(^|/)\.\.?(/|$))[A-Za-z0-9._/+-]{1,512}$")
_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")
_LABEL_VALUE_RE = re.compile(r"^[A-Za-z0-9._:/+-]{0,63}$")
_PATTERN_RE = re.compile(r"^[A-Za-z0-9._:*?\[\]!-]{1,253}$")

_STRICT = ConfigDict(extra="forbid", frozen=True)
"""Unknown keys refused; numbers are strict per field (`"3"` is not 3), JSON arrays are read as tuples."""


class HubSource(BaseModel):
    """A Hugging Face hub repository (vLLM) or one GGUF file of it (llama.cpp), at a revision."""

    model_config = _STRICT

    repo: str = Field(pattern=_REPO_RE.pattern)
    """The repository id, `org/name`."""
    file: str | None = None
    """llama.cpp: the GGUF file's path in the repository (the first shard of a split model)."""
    revision: str = "main"
    """A branch, a tag or a 40-hex commit; resolved to its commit on apply."""

    @field_validator("file")
    @classmethod
    def _file(cls, value: str | None) -> str | None:
        if value is not None and not _FILE_RE.match(value):
            raise ValueError("must be a relative path of the repository such as model-q4_k_m.gguf (no '..')")
        return value

    @field_validator("revision")
    @classmethod
    def _revision(cls, value: str) -> str:
        if not _REVISION_RE.match(value):
            raise ValueError("must be a branch or tag name, or a 40-hex commit (no '..', no leading '/')")
        return value


class Source(BaseModel):
    """Where a deployment's model comes from: exactly one of `artifact` and `hub`."""

    model_config = _STRICT

    artifact: str | None = Field(default=None, pattern=_HEX_PREFIX_RE.pattern)
    """A GGUF generation of the shared model cache (`provisioning.model_cache_dir`): its `artifact_id`, or a
    unique prefix of it of at least 8 hex characters."""
    hub: HubSource | None = None
    """A hub repository (vLLM) or a GGUF file of one (llama.cpp)."""

    @model_validator(mode="after")
    def _one(self) -> Source:
        if (self.artifact is None) == (self.hub is None):
            raise ValueError("give exactly one of artifact and hub")
        return self


class Capacity(BaseModel):
    """A sizing by what each replica must hold at once: at least `sequences` sequences of `context_tokens` each."""

    model_config = _STRICT

    sequences: int = Field(strict=True, ge=1, le=MAX_SLOTS)
    """Parallel sequences (llama.cpp slots)."""
    context_tokens: int = Field(strict=True, ge=256, le=1_048_576)
    """Tokens each sequence is guaranteed."""


class Runtime(BaseModel):
    """How each replica's engine is sized: a sizing policy, or a capacity; neither means automatic."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sizing: AutoPolicy | CustomPolicy | None = None
    """The llama.cpp sizing policy (`qiip_core.planner`): `{"sizing": "auto"}` or a custom one."""
    capacity: Capacity | None = None
    """At least this many sequences of this many tokens per replica; the planner picks the K/V cache type."""

    @model_validator(mode="before")
    @classmethod
    def _policy(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and isinstance(data.get("sizing"), Mapping):
            data = {**data, "sizing": parse_policy(data["sizing"])}
        return data

    @model_validator(mode="after")
    def _one(self) -> Runtime:
        if self.sizing is not None and self.capacity is not None:
            raise ValueError("give at most one of sizing and capacity")
        return self

    def policy(self) -> AutoPolicy | CustomPolicy:
        """The sizing policy a replica is planned with: a capacity becomes a custom sizing with F16 K/V (the
        planner's check then proves it fits; `placement` tries Q8_0 when F16 does not).

        Returns:
            The policy.
        """
        if self.capacity is not None:
            return CustomPolicy(
                fit_target_mib=512,
                context_per_slot=self.capacity.context_tokens,
                slots=self.capacity.sequences,
                cache_type="f16",
            )
        return self.sizing or AutoPolicy()


class Placement(BaseModel):
    """Which hosts of the pool may hold a replica. Every rule must hold."""

    model_config = _STRICT

    hosts: tuple[str, ...] = Field(default=(), max_length=64)
    """Host name patterns (`fnmatch`: `gpu*`, `lab-[0-9]*`); empty: every host of the pool."""
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    """Labels the host must carry, each with this value."""
    gpu_product: str | None = Field(default=None, pattern=_PATTERN_RE.pattern)
    """A pattern (`fnmatch`, case-insensitive) every GPU's product name must match (`*A100*`)."""
    min_gpu_memory_mib: int | None = Field(strict=True, default=None, ge=1, le=16_777_216)
    """Each GPU's total memory must be at least this many MiB."""
    quads_free_for_s: int | None = Field(strict=True, default=None, ge=0, le=366 * 86_400)
    """QUADS must leave the host free of any reservation for this many seconds from now (None:
    `quads.lookahead_s`); a replica whose host stops meeting it is moved, make-before-break."""

    @model_validator(mode="after")
    def _shapes(self) -> Placement:
        for pattern in self.hosts:
            if not _PATTERN_RE.match(pattern):
                raise ValueError(f"host pattern {pattern!r} may hold letters, digits, '.', '-', ':' and * ? [ ] !")
        for key, value in self.labels.items():
            if not _LABEL_KEY_RE.match(key):
                raise ValueError(f"label key {key!r} must be 1-63 letters, digits, '.', '_', '/' or '-'")
            if not _LABEL_VALUE_RE.match(value):
                raise ValueError(f"label {key}'s value {value!r} must be at most 63 letters, digits or . _ : / + -")
        return self


class UpdateStrategy(BaseModel):
    """How a rollout replaces replicas: new ones first (`max_surge`), never fewer than `replicas` serving by
    default (`max_unavailable` 0)."""

    model_config = _STRICT

    max_surge: int = Field(strict=True, default=1, ge=0, le=100)
    """Replicas a rollout may run above `replicas`."""
    max_unavailable: int = Field(strict=True, default=0, ge=0, le=100)
    """Replicas a rollout may take away below `replicas`."""

    @model_validator(mode="after")
    def _progress(self) -> UpdateStrategy:
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise ValueError("max_surge and max_unavailable cannot both be 0: a rollout could never progress")
        return self


class Autoscale(BaseModel):
    """Replica counts that follow demand, between `min` and `max` (`mode` off: `replicas` holds)."""

    model_config = _STRICT

    min: int = Field(strict=True, default=1, ge=0, le=1000)
    """The fewest replicas; 0 releases every host while the model is idle (it starts on the next request)."""
    max: int = Field(strict=True, default=1, ge=1, le=1000)
    """The most replicas."""
    metric: Literal["in_flight_per_slot", "in_flight_per_replica", "queued", "ttft_p90_s"] = "in_flight_per_slot"
    """What is compared with `target`: requests in flight per llama.cpp slot, per replica (vLLM), requests
    waiting at the gateway, or the 90th percentile of time to first token over the window, in seconds."""
    target: float = Field(strict=True, default=0.8, gt=0, le=1_000_000)
    """The value the metric is held at."""
    tolerance: float = Field(strict=True, default=0.1, ge=0, lt=1)
    """Scale down only below `target × (1 − tolerance)`."""
    up_window_s: float = Field(strict=True, default=30.0, ge=0, le=86_400)
    """The metric must stay above target this long before a scale-up."""
    down_window_s: float = Field(strict=True, default=300.0, ge=0, le=86_400)
    """…and below `target × (1 − tolerance)` this long before a scale-down."""
    cooldown_s: float = Field(strict=True, default=60.0, ge=0, le=86_400)
    """At most one step per cooldown."""
    mode: Literal["off", "recommend", "active"] = "off"
    """`recommend`: compute and show the count, change nothing; `active`: scale."""
    activation_timeout_s: float = Field(strict=True, default=120.0, gt=0, le=3_600)
    """With `min` 0: how long a request waits for the first replica before 503."""
    activation_queue: int = Field(strict=True, default=64, ge=1, le=100_000)
    """With `min` 0: how many requests may wait for the first replica at once; more get 503 at once."""

    @model_validator(mode="after")
    def _bounds(self) -> Autoscale:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self


class DeploymentSpec(BaseModel):
    """What an operator declares (see the module's example)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=DEPLOYMENT_NAME_RE.pattern)
    """The model name clients send; unique among deployments."""
    engine: ProvisionedEngine = Engine.LLAMA_CPP
    """The inference engine each replica runs."""
    source: Source
    """Where the model comes from."""
    runtime: Runtime = Field(default_factory=Runtime)
    """How each replica is sized (llama.cpp)."""
    replicas: int = Field(strict=True, default=1, ge=0, le=1000)
    """How many replicas to keep (with autoscaling active: where it starts)."""
    placement: Placement = Field(default_factory=Placement)
    """Which hosts may hold a replica."""
    update: UpdateStrategy = Field(default_factory=UpdateStrategy)
    """How rollouts replace replicas."""
    autoscale: Autoscale = Field(default_factory=Autoscale)
    """Replica counts that follow demand (off by default)."""

    @model_validator(mode="after")
    def _engine_rules(self) -> DeploymentSpec:
        if self.engine is Engine.VLLM:
            if self.source.artifact is not None:
                raise ValueError("source.artifact names a GGUF generation, which vLLM does not serve; use source.hub")
            if self.source.hub is not None and self.source.hub.file is not None:
                raise ValueError("source.hub.file names a GGUF file; vLLM serves the whole repository")
            if self.runtime.sizing is not None:
                raise ValueError("runtime.sizing is llama.cpp's; vLLM sizes itself")
        elif self.source.hub is not None and self.source.hub.file is None:
            raise ValueError(f"source.hub.file is required for {self.engine.label}: the GGUF file to serve")
        if self.engine is Engine.OLLAMA:
            # Each replica's Ollama daemon names the model as the deployment: it must be a name Ollama takes.
            try:
                check_ollama_name(ollama_model_key(self.name))
            except ValueError as exc:
                raise ValueError(f"an Ollama deployment's name is its model's name on Ollama, and {exc}") from None
        return self


_HINTS = {
    "name": "1-128 letters, digits or . _ : / @ + - starting with a letter or digit (the model name clients send)",
    "engine": PROVISIONED_ENGINE_CHOICES,
    "source.artifact": "an artifact id, or a prefix of one of at least 8 lowercase hex characters",
    "source.hub.repo": "a repository id such as org/name",
    "source.hub.file": "a relative path of the repository such as model-q4_k_m.gguf",
    "source.hub.revision": "a branch or tag name, or a 40-hex commit",
    "placement.gpu_product": "a name pattern such as *A100*",
}


def _field(loc: tuple[int | str, ...]) -> str:
    # pydantic puts the type of a union member in the location ("function-after[...]"); keep the field names.
    parts = [str(p) for p in loc if not str(p).startswith(("function-", "constrained-")) and p not in ("model",)]
    return ".".join(parts) or "deployment"


def _violations(error: ValidationError) -> list[Violation]:
    found: list[Violation] = []
    for item in error.errors():
        field = _field(item["loc"])
        kind = item["type"]
        if kind == "extra_forbidden":
            message = f"{field} is not a deployment field."
        elif kind == "missing":
            message = f"{field} is required."
        elif kind == "value_error":
            message = f"{field}: {str(item['msg']).removeprefix('Value error, ')}."
        else:
            hint = _HINTS.get(field)
            got = item.get("input")
            shown = repr(got) if not isinstance(got, dict | list) else type(got).__name__
            message = f"{field} must be {hint}, got {shown}." if hint else f"{field}: {item['msg']} (got {shown})."
        if all(v.field != field for v in found):
            found.append(Violation(field, message))
    return found


def parse_spec(data: Mapping[str, Any]) -> DeploymentSpec:
    """Check a deployment as decoded from TOML or JSON and return its spec.

    Args:
        data: the decoded document.

    Returns:
        The spec.

    Raises:
        DeploymentInvalid: a rule is broken; `.violations` lists each field at fault with a full sentence, and the
            message joins them.
    """
    if not isinstance(data, Mapping):
        raise DeploymentInvalid(
            "A deployment is a TOML table or a JSON object.", violations=[Violation("deployment", "not an object")]
        )
    try:
        return DeploymentSpec.model_validate(dict(data))
    except PlanError as exc:
        violations = [Violation(f"runtime.sizing.{v.field}", v.message) for v in exc.violations]
        raise DeploymentInvalid("The deployment is invalid: " + exc.message, violations=violations) from None
    except ValidationError as exc:
        violations = _violations(exc)
        raise DeploymentInvalid(
            "The deployment is invalid: " + " ".join(v.message for v in violations), violations=violations
        ) from None
