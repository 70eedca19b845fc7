"""The node: one inference server behind the gateway, as the registry records it.

A `Node` is the registration record: what the registry (the embedded state file or etcd) stores and
what the admin API shows. It is immutable; a change is a new record (`model_copy(update=...)`). What
the gateway observes at run time (in-flight requests, the circuit breaker, health counters) lives in the
routing table beside it, not in the record.

The JSON form is compatible with the seed system's etcd values: unknown fields are ignored, a missing
`managed` means externally owned.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

__all__ = [
    "LIFECYCLE_STATUSES",
    "LIVENESS_STATUSES",
    "PROVISIONED_ENGINES",
    "PROVISIONED_ENGINE_CHOICES",
    "ApiName",
    "DeploymentRef",
    "Engine",
    "LlamaCppRuntime",
    "ModelName",
    "Node",
    "NodeCapabilities",
    "NodeStatus",
    "ProvisionedEngine",
    "check_model_name",
]


class NodeStatus(StrEnum):
    """Where a node is in its life. Only `healthy` nodes receive traffic."""

    HEALTHY = "healthy"
    """Passing health checks; routable."""
    UNHEALTHY = "unhealthy"
    """Failing health checks or its circuit breaker is open."""
    DRAINING = "draining"
    """Finishing in-flight requests; receives nothing new."""
    RELAUNCHING = "relaunching"
    """Being restarted with a new sizing policy."""
    RELAUNCH_FAILED = "relaunch_failed"
    """A relaunch and its rollback both failed; only teardown is allowed."""
    PROVISIONING = "provisioning"
    """Being installed over SSH; not yet serving."""
    FAILED = "failed"
    """Provisioning failed."""
    UNKNOWN = "unknown"
    """Registered but not yet observed (or still loading its model)."""


LIVENESS_STATUSES = frozenset({NodeStatus.HEALTHY, NodeStatus.UNHEALTHY, NodeStatus.UNKNOWN})
"""Statuses a gateway observes for itself; its own observation beats one read from a shared registry."""

LIFECYCLE_STATUSES = frozenset(NodeStatus) - LIVENESS_STATUSES
"""Statuses set by an operation (drain, relaunch, provisioning); they always win over observation."""


class Engine(StrEnum):
    """The inference server a node runs."""

    VLLM = "vllm"
    """vLLM's OpenAI-compatible server."""
    LLAMA_CPP = "llama_cpp"
    """llama.cpp's `llama-server`."""
    ATTACHED = "attached"
    """An existing OpenAI-compatible server attached by an administrator."""
    OLLAMA = "ollama"
    """An Ollama server: served on its OpenAI-compatible routes, watched on its native ones (`/api/version`,
    `/api/tags`, `/api/ps`)."""

    @property
    def label(self) -> str:
        """The engine's name as operators read it: `vLLM`, `llama.cpp`, `attached`, `Ollama`."""
        return _ENGINE_LABELS[self]

    @property
    def serves_gguf(self) -> bool:
        """True for the engines QIIP gives a GGUF of its catalog, sized by its planner: llama.cpp and Ollama (which
        runs llama.cpp's kernels). vLLM takes a Hugging Face repository and sizes itself."""
        return self in (Engine.LLAMA_CPP, Engine.OLLAMA)


_ENGINE_LABELS = {
    Engine.VLLM: "vLLM",
    Engine.LLAMA_CPP: "llama.cpp",
    Engine.ATTACHED: "attached",
    Engine.OLLAMA: "Ollama",
}

_Provisioned = Literal[Engine.LLAMA_CPP, Engine.VLLM, Engine.OLLAMA]

PROVISIONED_ENGINES: tuple[Engine, ...] = get_args(_Provisioned)
"""The engines QIIP installs and starts on a host (`qiip node setup`, deployments); `attached` servers are not."""

PROVISIONED_ENGINE_CHOICES = ", ".join(repr(engine.value) for engine in PROVISIONED_ENGINES[:-1]) + (
    f" or {PROVISIONED_ENGINES[-1].value!r}"
)
"""`'llama_cpp', 'vllm' or 'ollama'`: the provisioned engines as a refusal names them."""


def _provisioned(value: object) -> object:
    # Refuse in one line naming the values a setup takes (pydantic's own text for a Literal of enum members is
    # their repr, `<Engine.VLLM: 'vllm'>`); the Literal then turns the name into the member.
    if not isinstance(value, str) or value not in PROVISIONED_ENGINES:
        raise PydanticCustomError(
            "literal_error", "Input should be {expected}", {"expected": PROVISIONED_ENGINE_CHOICES}
        )
    return value


ProvisionedEngine = Annotated[_Provisioned, BeforeValidator(_provisioned)]
"""A pydantic field type: an engine QIIP installs (`Engine.LLAMA_CPP`, `Engine.VLLM` or `Engine.OLLAMA`), read from
its value (`"llama_cpp"`, `"vllm"`, `"ollama"`) and written as it; anything else is refused with
`Input should be 'llama_cpp', 'vllm' or 'ollama'`.
Its JSON schema is the string enum of those values."""


def check_model_name(value: str) -> str:
    """Check a served model name (a node's `model`, a local node's alias): what clients send as `model`, shown in
    `/v1/models`, logs and the console, so it must be printable, with no surrounding whitespace.

    Args:
        value: the name; its length (1 to 512 characters) is `ModelName`'s rule.

    Returns:
        `value` unchanged.

    Raises:
        ValueError: it holds a control character (a newline, a bell, NUL) or other non-printable character, or
            starts or ends with whitespace.
    """
    if not value.isprintable() or value != value.strip():
        raise ValueError("model must be printable with no surrounding whitespace")
    return value


ModelName = Annotated[str, Field(min_length=1, max_length=512), AfterValidator(check_model_name)]
"""A served model name: 1 to 512 printable characters, with no surrounding whitespace (`check_model_name`)."""

ApiName = Literal["chat", "completions", "embeddings"]
"""An OpenAI inference API: `/v1/chat/completions`, `/v1/completions` or `/v1/embeddings`."""


class NodeCapabilities(BaseModel):
    """What a node can serve. Unknown keys are ignored.

    Attributes:
        max_tokens: the largest `max_tokens` the node accepts, when known.
        gpu_memory: a free-form description of the node's GPU memory (seed-compatible).
        endpoints: which OpenAI APIs the node serves; requests for another API never go to it, and the
            health checker's recovery probe uses the first of `completions`, `chat`, `embeddings` it lists.
        concurrency: at most this many requests in flight to the node (None: no cap).
        deadline_s: the longest a request to the node may take, start to end, in seconds (None: no limit
            beyond the gateway's timeouts).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    max_tokens: int | None = Field(default=None, ge=1)
    gpu_memory: str = ""
    endpoints: tuple[ApiName, ...] = ("chat", "completions", "embeddings")
    concurrency: int | None = Field(default=None, ge=1)
    deadline_s: float | None = Field(default=None, gt=0)


class LlamaCppRuntime(BaseModel):
    """The verified runtime record of a llama.cpp node (seed contract `llamacpp_runtime`).

    Attributes:
        requested: the sizing policy asked for (`sizing` = `auto` or `custom`, `fit_target_mib`, …).
        effective: what the running server reports (`context_per_slot`, `slots`, `cache_type_k`, …).
        gpus: per-device memory after load, `[{index, total_mib, used_mib, free_mib}]`.
        observed_at: when it was observed; always timezone-aware.
        architecture: the model's `general.architecture` (`gemma3`, `qwen3moe`, …), when known.
        memory: the caches the server allocated and the verifier matched against the plan,
            `[{kind: kv|kv_swa|recurrent, cells, layers, type_k, type_v, mib}]`; empty for an encoder, or when
            the architecture's caches are not modelled.
        unverified: checks that could not be made, each `"<check>: <why>"` (an architecture whose caches
            the planner does not model is verified on the facts every server logs, and says so here).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    requested: dict[str, Any]
    effective: dict[str, Any]
    gpus: list[dict[str, Any]] = Field(default_factory=list)
    observed_at: datetime
    architecture: str | None = None
    memory: list[dict[str, Any]] = Field(default_factory=list)
    unverified: list[str] = Field(default_factory=list)

    @field_validator("observed_at")
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("observed_at must carry a timezone")
        return value


class DeploymentRef(BaseModel):
    """The deployment a node is a replica of (`qiip_core.deployments`): the node was created by its controller, which
    alone changes or removes it.

    Attributes:
        name: the deployment's name (the model the node serves).
        template: the hash of the template the replica runs (another hash: an old replica a rollout replaces).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str = Field(min_length=1, max_length=128)
    template: str = Field(pattern=r"^[0-9a-f]{12}$")


class Node(BaseModel):
    """A registered inference node.

    Attributes:
        id: a stable name, usually the host name (`gpu01`); 1–128 characters of `[A-Za-z0-9._:-]`.
        endpoint: the normalised `scheme://host:port` the gateway forwards to.
        status: the registry's view of the node; see `NodeStatus`.
        model: the served model alias, an opaque string (`org/name`, `name:tag`) matched exactly
            against the request's `model`.
        engine: the inference server.
        artifact_id: the 64-hex identity of the exact model files, when known.
        llamacpp_runtime: the verified llama.cpp sizing record, when known.
        capabilities: what the node serves.
        managed: True when QIIP launched the node and owns its lifecycle.
        last_heartbeat: the last successful health observation (UTC).
        deployment: the deployment the node is a replica of, when a deployment's controller created it.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    endpoint: str
    status: NodeStatus = NodeStatus.UNKNOWN
    model: ModelName
    engine: Engine = Engine.VLLM
    artifact_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    llamacpp_runtime: LlamaCppRuntime | None = None
    capabilities: NodeCapabilities = Field(default_factory=NodeCapabilities)
    managed: bool = False
    last_heartbeat: datetime | None = None
    deployment: DeploymentRef | None = None
