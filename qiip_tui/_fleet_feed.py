"""The fleet as the console knows it, fed by the daemon: the connection's snapshot and events, the periodic
metrics poll, the QUADS hosts poll, and the node screen's polls.

```
FleetFeed.poll_metrics()   worker, every metrics_interval_s: metrics() + nodes()  → MetricsPolled
   └── _poll_lent_hosts    worker, with each metrics poll: lent_hosts()          → LentHostsPolled
FleetFeed.signal           the fleet's changes, batched, for the screens          (FleetDelta)
```

The app hands each message to the feed (`loaded`, `changed`, `metrics_polled`, …), on the UI thread; the feed
changes `fleet` and queues what changed, and the screens hear of every change queued by one batch of messages at
once, so a burst of events costs one table update.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from textual.signal import Signal

from qiip_core.client import ClientError
from qiip_tui._fleet import Fleet, FleetDelta
from qiip_tui._messages import LentHostsPolled, MetricsPolled
from qiip_tui._types import LentHostSource

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import datetime

    from textual.app import App
    from textual.worker import Worker

    from qiip_core.client import LentHosts, NodeEvent, NodeInfo
    from qiip_tui._connection_watch import ConnectionWatch
    from qiip_tui._types import Clock, ConsoleClient

__all__ = ["FleetFeed"]


class FleetFeed:
    """The fleet, kept current, and its signal.

    Args:
        app: the app that runs the polls, receives their messages and schedules the batched signal.
        client: the daemon's client.
        connection: the connection, which a failed poll restarts (the event stream may hang on a dead socket).
        clock: a monotonic clock in seconds, for rates.
        wall_clock: the time of day (UTC), for `last_update`.
    """

    def __init__(
        self,
        app: App[Any],
        client: ConsoleClient,
        connection: ConnectionWatch,
        *,
        clock: Clock,
        wall_clock: Callable[[], datetime],
    ) -> None:
        self._app = app
        self._client = client
        self._connection = connection
        self._clock = clock
        self._wall_clock = wall_clock
        self.fleet = Fleet()
        """Every node the daemon reported."""
        self.signal: Signal[FleetDelta] = Signal(app, "fleet")
        """Published with the nodes that changed, at most once per batch of messages; empty after a poll."""
        self.last_update: datetime | None = None
        """When the daemon last told the console something (a snapshot, an event, a poll), UTC."""
        self._reads_quads: bool | None = None  # None: not asked since connecting
        self._pending = FleetDelta()
        self._flush_scheduled = False

    # -- what the daemon said ----------------------------------------------------------------------------

    def loaded(self, nodes: list[NodeInfo]) -> None:
        """The whole fleet (`FleetLoaded`)."""
        self.last_update = self._wall_clock()
        self._publish(self.fleet.load(nodes))

    def reconnected(self) -> None:
        """The console is connected again: the daemon may have restarted with other settings; poll at once (rates
        and TTFT now, rather than one interval later)."""
        self._reads_quads = None
        self.poll_metrics()

    def changed(self, event: NodeEvent) -> None:
        """One event of the stream (`NodeChanged`)."""
        self.last_update = self._wall_clock()
        self._publish(self.fleet.apply(event))

    def metrics_polled(self, message: MetricsPolled) -> None:
        """The periodic poll's counters and nodes (`MetricsPolled`)."""
        self.last_update = self._wall_clock()
        changed = set(self.fleet.apply_metrics(message.payload, at_s=message.at_s).changed)
        update = self.fleet.update
        for node in message.nodes:
            changed.update(update(node).changed)
        if changed:
            self._publish(FleetDelta(changed=frozenset(changed)))
        # An empty change says a poll happened: the summary's rate and the errors' ages move on.
        self.signal.publish(FleetDelta())

    def node_polled(self, node: NodeInfo) -> None:
        """One node, as the node screen polled it (`NodePolled`)."""
        if node.id in self.fleet.nodes:
            self._publish(self.fleet.update(node))

    def lent_polled(self, lent: LentHosts) -> None:
        """The hosts QUADS lends (`LentHostsPolled`); a daemon without [quads] is not asked again until the console
        reconnects."""
        self._reads_quads = lent.freshness is not None
        self.fleet.lent = lent if self._reads_quads else None
        self.signal.publish(FleetDelta())

    # -- polls -------------------------------------------------------------------------------------------

    def poll_metrics(self) -> Worker[None]:
        """Poll the metrics and the nodes' live values now (a poll already running is replaced).

        Returns:
            The worker that polls.
        """
        return self._app.run_worker(self._poll_metrics, group="metrics", exclusive=True, exit_on_error=False)

    async def _poll_metrics(self) -> None:
        if not self._connection.connected:
            return
        client = self._client
        try:
            payload = await client.metrics()
            nodes = await client.nodes()
        except ClientError:
            # The event stream may be stuck on a dead connection: start over, which reports the outage.
            self._connection.follow()
            return
        self._app.post_message(MetricsPolled(payload, nodes, at_s=self._clock()))
        if self._reads_quads is not False and isinstance(client, LentHostSource):
            self._poll_lent_hosts(client)

    def _poll_lent_hosts(self, client: LentHostSource) -> Worker[None]:
        # Its own worker: a slow answer must not hold up (or, overlapping the next, cancel) the metrics poll.
        work = partial(self._read_lent_hosts, client)
        return self._app.run_worker(work, group="quads", exclusive=True, exit_on_error=False)

    async def _read_lent_hosts(self, client: LentHostSource) -> None:
        try:
            lent = await client.lent_hosts()
        except ClientError:
            return  # the metrics poll reports an outage
        self._app.post_message(LentHostsPolled(lent))

    # -- batching ----------------------------------------------------------------------------------------

    def _publish(self, delta: FleetDelta) -> None:
        """Queue a change; the screens hear of all changes queued by the same batch of messages at once."""
        self._pending = self._pending.merge(delta)
        if delta and not self._flush_scheduled:
            self._flush_scheduled = True
            self._app.call_later(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        delta, self._pending = self._pending, FleetDelta()
        if delta:
            self.signal.publish(delta)
