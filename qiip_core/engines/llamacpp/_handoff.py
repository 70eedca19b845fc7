"""The hand-off from `qiip up` to the daemon it starts: the local nodes it planned, as one typed, versioned record.

`qiip up` checks and plans every model before anything starts (`plan_local_nodes`). What it resolved on the way
(the llama.cpp build, each artifact's whole id and entrypoint, the sizing, whether a model is served for
embeddings) travels to the daemon in `QIIP_LOCAL_NODE_PLAN` as a `LocalNodeHandoff`, written and read here only,
and the daemon launches exactly that without looking any of it up again.

```
LocalNodeHandoff(version=1, engine=InstalledEngine, nodes=[LocalNodePlan, …])
  .to_json() -> str                         what `qiip up` puts in QIIP_LOCAL_NODE_PLAN
  .from_environ(os.environ) -> … | None     what the daemon reads; ConfigError names the variable and the field
LocalNodePlan(id, model, gguf, artifact_id, sizing, embeddings)
  .config() -> LocalNodeConfig              the `[[local_nodes]]` entry the daemon's settings hold for it
```

The daemon still reads each GGUF once more when it launches it: the file may change between the two processes
(a download finishing, a file replaced), and the launch plans against the memory free at that moment.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qiip_core._errors import ConfigError
from qiip_core._violation import first_violation
from qiip_core.config import LOCAL_NODE_PLAN_VARIABLE, LocalNodeConfig
from qiip_core.engines.llamacpp._install import InstalledEngine
from qiip_core.engines.llamacpp._paths import AbsolutePath
from qiip_core.nodes import ModelName
from qiip_core.planner import MAX_AGGREGATE_CONTEXT, AutoPolicy, CustomPolicy, SizingPolicy, validate_policy

__all__ = ["LOCAL_NODE_HANDOFF_VERSION", "LocalNodeHandoff", "LocalNodePlan"]

LOCAL_NODE_HANDOFF_VERSION = 1
"""The version of `LocalNodeHandoff` this code writes and reads; the daemon refuses any other."""

_RECORD = ConfigDict(extra="forbid", frozen=True)


class LocalNodePlan(BaseModel):
    """One local node as `qiip up` planned it: what to serve, under which id and name, with which sizing."""

    model_config = _RECORD

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    """The node id (`local`, `local-2`, …)."""
    model: ModelName
    """The alias clients use as `model`: printable, with no surrounding whitespace (as a node's `model`)."""
    gguf: AbsolutePath
    """The GGUF to serve (the first shard of a split family): the file given, or the artifact's entrypoint; an
    absolute path."""
    artifact_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """The whole id of the artifact `gguf` is the entrypoint of (the node record carries it); None for a file."""
    sizing: SizingPolicy
    """The sizing to launch: custom as planned, or automatic (planned again at launch)."""
    embeddings: bool
    """Serve `/v1/embeddings` (asked for, or an embedding model) instead of generation."""

    @field_validator("sizing")
    @classmethod
    def _valid_sizing(cls, sizing: AutoPolicy | CustomPolicy) -> AutoPolicy | CustomPolicy:
        # The planner's own rules, those that hold for any model and device (slots, the context step, the
        # aggregate context, a fit target of at least 0): no training context to exceed, no device to fit here.
        found = validate_policy(sizing, train_context=MAX_AGGREGATE_CONTEXT, devices=[])
        if found:
            raise ValueError(" ".join(v.message for v in found).removesuffix("."))
        return sizing

    def config(self) -> LocalNodeConfig:
        """The `[[local_nodes]]` entry this node is in the daemon's settings: the file, or the artifact's whole id
        (what a recorded relaunch compares with, `RelaunchedSizings`), the alias, the sizing and `embeddings`."""
        return LocalNodeConfig(
            id=self.id,
            gguf=None if self.artifact_id is not None else self.gguf,
            artifact_id=self.artifact_id,
            model=self.model,
            sizing=self.sizing.model_dump(mode="json"),
            embeddings=self.embeddings,
        )


class LocalNodeHandoff(BaseModel):
    """The local nodes `qiip up` hands the daemon it starts (in `QIIP_LOCAL_NODE_PLAN`), and the engine it planned
    them with."""

    model_config = _RECORD

    version: int = Field(strict=True)
    """The record's version: `LOCAL_NODE_HANDOFF_VERSION` (a JSON integer: not `true`, not `1.0`)."""
    engine: InstalledEngine
    """The llama.cpp build `qiip up` found (or built) and planned with; the daemon launches it."""
    nodes: list[LocalNodePlan] = Field(min_length=1)
    """The nodes, in launch order."""

    @model_validator(mode="after")
    def _unique_ids(self) -> LocalNodeHandoff:
        ids = [node.id for node in self.nodes]
        for node_id in ids:
            if ids.count(node_id) > 1:
                raise ValueError(f"node id {node_id!r} appears twice")
        return self

    def to_json(self) -> str:
        """The record as `QIIP_LOCAL_NODE_PLAN` carries it (JSON)."""
        return self.model_dump_json()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> LocalNodeHandoff | None:
        """The record in `environ`'s `QIIP_LOCAL_NODE_PLAN`, or None when it is not set.

        Raises:
            ConfigError: the value is not JSON (or nests deeper than Python can read), its `version` is not the
                integer `LOCAL_NODE_HANDOFF_VERSION`, or a field is invalid; the message names the variable, the
                field (`nodes.0.sizing.custom.slots`, `nodes.0.gguf`) and why.
        """
        raw = environ.get(LOCAL_NODE_PLAN_VARIABLE)
        if raw is None:
            return None
        where = f"{LOCAL_NODE_PLAN_VARIABLE} (the local nodes `qiip up` hands the daemon)"
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(f"{where} is not JSON: {exc}.") from None
        except RecursionError:
            raise ConfigError(f"{where} is not a hand-off record: its JSON nests too deeply to read.") from None
        version = data.get("version") if isinstance(data, dict) else None
        if version is not None and type(version) is not int:
            raise ConfigError(
                f"{where} is invalid: version: must be the integer {LOCAL_NODE_HANDOFF_VERSION}, got {version!r}."
            )
        if version != LOCAL_NODE_HANDOFF_VERSION:
            raise ConfigError(
                f"{where} has version {version!r}; this daemon reads version {LOCAL_NODE_HANDOFF_VERSION}. Start it "
                "with the `qiip up` of the same installation."
            )
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            violation = first_violation(exc)
            field = violation.field or "the record"
            message = violation.message.removesuffix(".")
            raise ConfigError(f"{where} is invalid: {field}: {message}.") from None
