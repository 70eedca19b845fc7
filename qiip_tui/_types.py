"""The console's types: the client it needs, its clock, and the records its log view shows.

The console is written against `ConsoleClient`, the part of `qiip_core.client.QiipClient` it uses, so the
snapshot tests and the benchmark can drive it with canned data while everything else runs against a real
daemon through the real client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from qiip_core.client import ChatDelta, LentHosts, NodeEvent, NodeInfo, OperationInfo
    from qiip_core.recommendations import HostRecommendations

__all__ = [
    "Clock",
    "ConsoleClient",
    "CredentialsHolder",
    "DeploymentSource",
    "JournalSource",
    "LentHostSource",
    "LogRecord",
    "ModelCatalogSource",
    "ProvisioningSource",
    "RecommendationSource",
]

Clock = Callable[[], float]
"""A monotonic clock in seconds (`time.monotonic`); tests pass a frozen one."""


class ConsoleClient(Protocol):
    """What the console asks of a daemon; `QiipClient` is the implementation.

    Every method raises the `qiip_core.client.ClientError` family: `DaemonUnreachable`, `Unauthorized`
    or `ApiError`.
    """

    url: str
    """The daemon's base URL, for messages."""

    async def nodes(self) -> list[NodeInfo]: ...

    async def node(self, node_id: str) -> NodeInfo: ...

    async def drain(self, node_id: str, *, timeout_s: float | None = None) -> OperationInfo: ...

    async def undrain(self, node_id: str) -> NodeInfo: ...

    async def remove(self, node_id: str, *, force: bool = False) -> OperationInfo: ...

    async def relaunch(self, node_id: str, policy: Mapping[str, Any]) -> OperationInfo: ...

    async def operation(self, operation_id: str) -> OperationInfo: ...

    async def metrics(self) -> dict[str, Any]: ...

    def events(self, *, heartbeat_s: float = 15.0) -> AsyncIterator[NodeEvent]: ...

    async def models(self) -> list[str]: ...

    def chat_stream(
        self, model: str, messages: Sequence[Mapping[str, str]], *, max_tokens: int | None = None
    ) -> AsyncIterator[ChatDelta]: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class LogRecord:
    """One line of a log the console shows (provisioning output, an operation's log)."""

    level: str
    """`debug`, `info`, `warning` or `error`; anything else shows as `info`."""
    message: str
    """The line, without its trailing newline."""
    at: datetime | None = None
    """When it was written, if the source says."""
    source: str = ""
    """Who wrote it: a node id, a host, an operation."""
    tag: str | None = None
    """A short label shown in place of the level (a journal event: `status`, `breaker open`); None shows the level,
    empty shows nothing (an engine's own line)."""
    tag_style: str = ""
    """The palette style of `tag` (`status-unhealthy`, `log-error`); empty uses the level's."""


@runtime_checkable
class ProvisioningSource(Protocol):
    """A daemon that provisions hosts over SSH (`/admin/provisioning/*`, `/admin/nodes/setup`, host power);
    `QiipClient` is one. The provisioning screen and the host actions need it."""

    async def provisioning_tasks(self) -> list[dict[str, Any]]: ...

    def host_log(self, host: str, *, follow: bool = True) -> AsyncIterator[dict[str, Any]]: ...

    async def setup(self, body: Mapping[str, Any]) -> OperationInfo: ...

    async def cancel_provisioning(self, host: str) -> OperationInfo: ...

    async def power(self, host: str, action: str) -> dict[str, Any]: ...

    async def power_state(self, host: str) -> dict[str, Any]: ...


@runtime_checkable
class DeploymentSource(Protocol):
    """A daemon with deployments (`/admin/deployments/*`); `QiipClient` is one. The deployments screen needs it.

    Each method raises `qiip_core.client.ApiError` as the daemon answers: 404 from a daemon without the API (or
    for a deployment that is gone), 409 and 422 with the field at fault for a refused change.
    """

    async def deployments(self) -> list[dict[str, Any]]: ...

    def deployment_events(self, name: str, *, follow: bool = True, after: int = 0) -> AsyncIterator[dict[str, Any]]: ...

    async def scale_deployment(self, name: str, replicas: int, *, generation: int | None = None) -> dict[str, Any]: ...

    async def rollout_undo(self, name: str) -> dict[str, Any]: ...

    async def delete_deployment(self, name: str) -> dict[str, Any]: ...


@runtime_checkable
class JournalSource(Protocol):
    """A daemon with the fleet journal and engine logs (`/admin/journal`, `/admin/nodes/{id}/log`); `QiipClient` is
    one. The logs screen's timeline and engine-log panes need it."""

    def journal(self, *, follow: bool = True) -> AsyncIterator[dict[str, Any]]: ...

    def engine_log(self, node_id: str, *, lines: int = 200, follow: bool = True) -> AsyncIterator[dict[str, Any]]: ...


@runtime_checkable
class ModelCatalogSource(Protocol):
    """A daemon with the models API (`/admin/models/*`); `QiipClient` is one. The models screen needs it."""

    async def catalog(self) -> dict[str, Any]: ...

    async def downloads(self) -> list[dict[str, Any]]: ...

    async def start_download(
        self, repo_id: str, *, revision: str | None = None, files: Sequence[str] = ()
    ) -> dict[str, Any]: ...


@runtime_checkable
class RecommendationSource(Protocol):
    """A daemon that runs llmfit on hosts (`/admin/nodes/{host}/recommendations`); `QiipClient` is one. The
    recommendations screen needs it."""

    async def recommendations(
        self, host: str, *, profile: str | None = None, limit: int | None = None, timeout_s: float = ...
    ) -> HostRecommendations: ...


@runtime_checkable
class LentHostSource(Protocol):
    """A daemon that reads the QUADS lab scheduler (`GET /admin/nodes`: its `not_provisioned` entries and its
    `quads` freshness); `QiipClient` is one. The fleet summary's QUADS line needs it."""

    async def lent_hosts(self) -> LentHosts: ...


@runtime_checkable
class CredentialsHolder(Protocol):
    """A client whose admin credentials can be replaced (`QiipClient.set_credentials`): the console asks for a
    password when the daemon refuses the one it was given."""

    def set_credentials(self, username: str, password: str) -> None: ...
