"""What the daemon's pieces use of a gateway, as Protocols: the request path is typed against these, so the primary's
`Gateway` (the whole fleet runtime) and a worker's `_worker.WorkerGateway` (the request path alone) both serve it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from qiip_core.auth import AuthThrottle, TokenStore
    from qiip_core.config import Settings
    from qiip_core.deployments import DemandMeter
    from qiip_core.routing import Admission, Forwarder, RoutingTable
    from qiip_proxy._metrics import GatewayMetrics

__all__ = ["ServingGateway"]


class ServingGateway(Protocol):
    """What one serving process runs a client request with (`ProxyRoutes`, the client API's `/v1/…` routes,
    `wrap_serving`'s layers, the server): in the primary its `Gateway`, in a worker its `WorkerGateway`."""

    @property
    def settings(self) -> Settings: ...

    @property
    def table(self) -> RoutingTable:
        """The routing table: this process's view of the fleet, counting on the shared board with workers."""
        ...

    @property
    def admission(self) -> Admission: ...

    @property
    def forwarder(self) -> Forwarder: ...

    @property
    def metrics(self) -> GatewayMetrics: ...

    @property
    def tokens(self) -> TokenStore: ...

    @property
    def tokens_required(self) -> bool: ...

    @property
    def admin_throttle(self) -> AuthThrottle: ...

    @property
    def client_throttle(self) -> AuthThrottle: ...

    @property
    def parse_gate(self) -> asyncio.Semaphore: ...

    @property
    def streams_by_token(self) -> dict[str, set[Callable[[], None]]]: ...

    @property
    def shutting_down(self) -> bool: ...

    @property
    def demand_meter(self) -> DemandMeter: ...

    def wake_controller(self) -> None:
        """A request waits for a deployment's first replica: have the deployment controller look now (a worker's
        waiting requests reach the primary's controller with its report instead)."""

    def begin_shutdown(self) -> None:
        """The server stopped accepting connections: end what never ends by itself. Call on the event loop."""

    def force_shutdown(self) -> None:
        """The stop was forced (a second SIGINT during the grace): pass it on to the serving processes this one
        runs, so none of them waits out its grace. Call on the event loop."""
