"""Messages the app's workers post to the app.

Workers only await the client and post one of these; the app hands each to the collaborator it concerns
(`FleetFeed`, `ConnectionWatch`, `OperationTracker`), which publishes the change to the screens on its signal.
Widget messages are nested in the widget that posts them (`FleetTable.NodeChosen`, …).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual.message import Message

if TYPE_CHECKING:
    from qiip_core.client import ClientError, LentHosts, NodeEvent, NodeInfo, OperationInfo

__all__ = [
    "ConnectionLost",
    "FleetLoaded",
    "LentHostsPolled",
    "MetricsPolled",
    "NodeChanged",
    "NodePolled",
    "OperationUpdated",
]


class FleetLoaded(Message):
    """The daemon answered with its whole fleet: the console is connected (again).

    Posted by `ConnectionWatch.follow`'s worker after `client.nodes()`, before it opens the event stream.
    Handled by `QiipConsole.on_fleet_loaded`, which hands it to `FleetFeed.loaded` and `ConnectionWatch.answered`.
    """

    def __init__(self, nodes: list[NodeInfo]) -> None:
        super().__init__()
        self.nodes = nodes
        """Every node, as `GET /admin/nodes` answered."""


class NodeChanged(Message):
    """One change from the daemon's event stream.

    Posted by `ConnectionWatch.follow`'s worker for every `client.events()` item.
    Handled by `QiipConsole.on_node_changed`, which hands it to `FleetFeed.changed`.
    """

    def __init__(self, event: NodeEvent) -> None:
        super().__init__()
        self.event = event
        """`added`, `updated` or `removed`, with the node."""


class ConnectionLost(Message):
    """The daemon could not be reached or refused the credentials; the worker retries after `retry_in_s`, or
    waits for new credentials when they were refused (`retry_in_s` None).

    Posted by `ConnectionWatch.follow`'s worker after each failed attempt.
    Handled by `QiipConsole.on_connection_lost`, which hands it to `ConnectionWatch.lost`.
    """

    def __init__(self, error: ClientError, *, attempt: int, retry_in_s: float | None) -> None:
        super().__init__()
        self.error = error
        """Why: `DaemonUnreachable`, `Unauthorized` or `ApiError`."""
        self.attempt = attempt
        """Failed attempts in a row, from 1."""
        self.retry_in_s = retry_in_s
        """Seconds until the next attempt; None when the console waits for the operator."""


class MetricsPolled(Message):
    """The periodic poll read the request counters and the nodes' live values (in-flight, GPU memory).

    Posted by `FleetFeed.poll_metrics`'s worker every `metrics_interval_s`.
    Handled by `QiipConsole.on_metrics_polled`, which hands it to `FleetFeed.metrics_polled`.
    """

    def __init__(self, payload: dict[str, Any], nodes: list[NodeInfo], *, at_s: float) -> None:
        super().__init__()
        self.payload = payload
        """`GET /admin/metrics`: `{"by_model": …, "by_node": …}`."""
        self.nodes = nodes
        """`GET /admin/nodes`: the daemon's events do not report in-flight changes, the poll does."""
        self.at_s = at_s
        """When it was read, on the console's clock, in seconds."""


class LentHostsPolled(Message):
    """The periodic poll read the GPU hosts QUADS lends that are not nodes, and the freshness of the daemon's read
    of QUADS.

    Posted by `FleetFeed`'s QUADS worker, started by each metrics poll while the daemon may read QUADS.
    Handled by `QiipConsole.on_lent_hosts_polled`, which hands it to `FleetFeed.lent_polled`.
    """

    def __init__(self, lent: LentHosts) -> None:
        super().__init__()
        self.lent = lent
        """`QiipClient.lent_hosts()`; its `freshness` is None from a daemon without `[quads]`."""


class OperationUpdated(Message):
    """A background operation (drain, remove, relaunch) the console follows changed state or logged.

    Posted by `OperationTracker.track`, then by its worker on each poll of `client.operation(id)` that differs.
    Handled by `QiipConsole.on_operation_updated`, which hands it to `OperationTracker.updated` (it republishes
    it on `OperationTracker.signal`).
    """

    def __init__(self, operation: OperationInfo) -> None:
        super().__init__()
        self.operation = operation
        """The operation as the daemon reports it now."""


class NodePolled(Message):
    """A poll read one node (its memory and in-flight count change without an event).

    Posted by `NodeScreen._poll` to the node screen. Handled by `NodeScreen.on_node_polled`, which records the
    reading for its sparklines and lets the message bubble on to `QiipConsole.on_node_polled`, which hands it to
    `FleetFeed.node_polled`.
    """

    def __init__(self, node: NodeInfo) -> None:
        super().__init__()
        self.node = node
        """The node as `GET /admin/nodes/{id}` answered."""
