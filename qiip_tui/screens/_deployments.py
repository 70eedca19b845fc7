"""The deployments screen: every deployment with its replicas ready of desired and its state, and for the one
highlighted its replicas, its events as they happen, and its autoscaling metric against the target.

The list is polled while the screen is shown (`GET /admin/deployments`, which carries each status); the
highlighted deployment's events are followed (`GET …/events`, server-sent), the kept ones first. Scale, rollout
undo and delete ask first (`ConfirmModal`); a refusal is one line per field at fault (`ApiError.lines()`), and a
refused count brings the scale dialog back with what was typed. A daemon without the deployments API (404) is said
so, as the models screen says it of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.message import Message
from textual.timer import Timer
from textual.widgets import DataTable, Header, Label, Static

from qiip_core.client import ApiError, ClientError
from qiip_tui._deployments import (
    DEPLOYMENT_COLUMNS,
    REPLICA_COLUMNS,
    autoscale_line,
    autoscale_samples,
    autoscale_target,
    conditions_line,
    deployment_rows,
    event_record,
    replica_rows,
    summary_line,
)
from qiip_tui._types import DeploymentSource, LogRecord
from qiip_tui.screens._base import ConsoleScreen
from qiip_tui.screens._confirm import ConfirmModal
from qiip_tui.screens._scale import ScaleModal
from qiip_tui.widgets import ConsoleTable, KeyFooter, LogView, TargetSparkline

__all__ = ["DEPLOYMENTS_NOT_AVAILABLE", "DeploymentsScreen"]

DEPLOYMENTS_NOT_AVAILABLE = (
    "This daemon has no deployments API (/admin/deployments); upgrade it to see its deployments."
)
"""What the screen says when the client cannot ask for deployments, or the daemon answers 404."""

EVENTS_KEPT = 100
"""Events the screen keeps for the highlighted deployment (the daemon keeps as many)."""


def _lines(name: str, exc: ClientError) -> str:
    """The daemon's refusal, one line per field at fault, each led by the deployment."""
    lines = exc.lines() if isinstance(exc, ApiError) else [" ".join(exc.message.split())]
    return "\n".join(f"{name}: {line}" for line in lines)


def _if_confirmed(run: Callable[[], object]) -> Callable[[bool | None], None]:
    """A `ConfirmModal` callback that runs `run` when the operator confirmed."""

    def answered(answer: bool | None) -> None:
        if answer is not None:
            run()

    return answered


async def _records(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[LogRecord]:
    async for event in events:
        yield event_record(event)


class DeploymentsScreen(ConsoleScreen[None]):
    """Deployments, and the highlighted one's replicas, events and autoscaling."""

    AUTO_FOCUS = "#deployments"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("s", "scale", "Scale"),
        Binding("u", "undo", "Rollout undo"),
        Binding("x", "delete", "Delete"),
        Binding("r", "refresh", "Refresh"),
        Binding("q", "app.fleet", "Back"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | s | Scale the highlighted deployment (a dialog for the count, then a confirmation). |
    | u | Roll it back to its previous template (asks first). |
    | x | Delete it: its replicas drain and are torn down (asks first). |
    | r | Ask the daemon again now. |
    | q | Back to the fleet. |
    """

    poll_interval_s: float = 2.0
    """Seconds between polls of the deployments."""

    class Loaded(Message):
        """The daemon answered with its deployments (or could not).

        Posted by `DeploymentsScreen._load`. Handled by `DeploymentsScreen.on_deployments_screen_loaded`.
        """

        def __init__(self, deployments: list[dict[str, Any]] | None, error: str | None) -> None:
            super().__init__()
            self.deployments = deployments
            """Every deployment with its status, by name; None after an error."""
            self.error = error
            """Why the daemon could not be asked (`DEPLOYMENTS_NOT_AVAILABLE` for a daemon without the API)."""

    def __init__(self) -> None:
        super().__init__()
        self.deployments: dict[str, dict[str, Any]] = {}
        """The last answer, by name."""
        self.selected: str | None = None
        """The deployment highlighted, whose replicas and events are shown."""
        self._following: str | None = None
        self._poll: Timer | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("Asking the daemon for its deployments…", id="deployments-summary", markup=False)
        yield ConsoleTable[str](id="deployments", cursor_type="row", zebra_stripes=True)
        yield Static("", id="deployment-state", markup=False)
        with Horizontal(id="deployment-detail"):
            yield ConsoleTable[str](id="replicas", cursor_type="row", zebra_stripes=True)
            yield LogView(max_lines=EVENTS_KEPT, id="deployment-events")
        yield Label("", id="autoscale-line", markup=False)
        yield TargetSparkline(id="autoscale-sparkline")
        yield KeyFooter()

    def on_mount(self) -> None:
        self.query_one("#deployments", DataTable).add_columns(*DEPLOYMENT_COLUMNS)
        self.query_one("#replicas", DataTable).add_columns(*REPLICA_COLUMNS)
        self._show_detail(None)
        if not isinstance(self.console.client, DeploymentSource):
            self._say(DEPLOYMENTS_NOT_AVAILABLE, degraded=True)
            return
        self._load()
        self._poll = self.set_interval(self.poll_interval_s, self._load)

    def _say(self, text: str, *, degraded: bool = False) -> None:
        summary = self.query_one("#deployments-summary", Static)
        summary.update(text)
        summary.set_class(degraded, "-degraded")

    # -- the list ----------------------------------------------------------------------------------------

    def action_refresh(self) -> None:
        """Ask the daemon again now (and go on polling, after a daemon without the API was upgraded)."""
        if isinstance(self.console.client, DeploymentSource):
            self._load()
            if self._poll is not None:
                self._poll.resume()

    @work(exclusive=True, group="deployments", exit_on_error=False)
    async def _load(self) -> None:
        client = self.console.client
        assert isinstance(client, DeploymentSource)
        try:
            deployments = await client.deployments()
        except ApiError as exc:
            missing = exc.status == 404
            self.post_message(self.Loaded(None, DEPLOYMENTS_NOT_AVAILABLE if missing else " ".join(exc.lines())))
            return
        except ClientError as exc:
            self.post_message(self.Loaded(None, exc.message))
            return
        self.post_message(self.Loaded(deployments, None))

    def on_deployments_screen_loaded(self, message: Loaded) -> None:
        if message.deployments is None:
            if message.error == DEPLOYMENTS_NOT_AVAILABLE:
                self._say(DEPLOYMENTS_NOT_AVAILABLE, degraded=True)
                if self._poll is not None:
                    self._poll.pause()  # `r` asks again
            else:
                self._say(f"The deployments could not be read: {message.error}", degraded=True)
            return
        self.deployments = {str(d["name"]): d for d in message.deployments}
        self._say(summary_line(message.deployments))
        table = self.query_one("#deployments", ConsoleTable)
        table.show_rows(deployment_rows(message.deployments))
        selected = table.highlighted_key
        self._show_detail(selected)

    @on(DataTable.RowHighlighted, "#deployments")
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_detail(event.row_key.value if event.row_key is not None else None)

    # -- the highlighted deployment ----------------------------------------------------------------------

    def _show_detail(self, name: str | None) -> None:
        deployment = self.deployments.get(name) if name is not None else None
        self.selected = name if deployment is not None else None
        state = self.query_one("#deployment-state", Static)
        line = self.query_one("#autoscale-line", Label)
        sparkline = self.query_one("#autoscale-sparkline", TargetSparkline)
        replicas = self.query_one("#replicas", ConsoleTable)
        if deployment is None:
            state.update("")
            replicas.show_rows([])
            line.display = sparkline.display = False
            self._follow(None)
            return
        state.update(conditions_line(deployment))
        nodes = {node_id: node.status for node_id, node in self.console.fleet.nodes.items()}
        replicas.show_rows(replica_rows(deployment, nodes))
        autoscale = autoscale_line(deployment)
        line.display = sparkline.display = autoscale is not None
        if autoscale is not None:
            line.update(autoscale)
            sparkline.values = tuple(autoscale_samples(deployment))
            sparkline.target = autoscale_target(deployment)
        self._follow(self.selected)

    def _follow(self, name: str | None) -> None:
        """Follow `name`'s events (the kept ones first), or none; the same deployment is not followed again."""
        if name == self._following:
            return
        self._following = name
        view = self.query_one("#deployment-events", LogView)
        view.clear()
        client = self.console.client
        if name is not None and isinstance(client, DeploymentSource):
            view.follow_source(_records(client.deployment_events(name)))

    def on_log_view_source_ended(self, message: LogView.SourceEnded) -> None:
        message.stop()
        if message.error and message.view is not None:
            message.view.write(LogRecord(level="error", message=f"The events stopped: {message.error}"))

    # -- actions -----------------------------------------------------------------------------------------

    def _highlighted_deployment(self) -> dict[str, Any] | None:
        deployment = self.deployments.get(self.selected) if self.selected is not None else None
        if deployment is None:
            self.notify("Highlight a deployment first.", severity="warning")
        return deployment

    def action_scale(self) -> None:
        """Ask for the highlighted deployment's replica count, confirm, then send it."""
        deployment = self._highlighted_deployment()
        if deployment is not None:
            self._ask_scale(deployment)

    def _ask_scale(self, deployment: dict[str, Any], *, value: str | None = None, problem: str | None = None) -> None:
        name, now = str(deployment["name"]), int(deployment["spec"]["replicas"])

        def asked(count: int | None) -> None:
            if count is None:
                return
            body = f"{name} keeps {count} replica(s) instead of {now}."
            if count < now:
                body += " The extra replicas drain first, then are torn down."
            if (deployment["spec"].get("autoscale") or {}).get("mode") == "active":
                body += " Autoscaling is active: it moves the count between its bounds from there."
            self.app.push_screen(
                ConfirmModal(f"Scale {name} to {count}?", body, confirm="Scale"),
                _if_confirmed(lambda: self._scale(deployment, count)),
            )

        self.app.push_screen(ScaleModal(name, now, value=value, problem=problem), asked)

    @work(group="deployment-actions", exit_on_error=False)
    async def _scale(self, deployment: dict[str, Any], count: int) -> None:
        client = self.console.client
        assert isinstance(client, DeploymentSource)
        name = str(deployment["name"])
        try:
            result = await client.scale_deployment(name, count, generation=int(deployment["generation"]))
        except ClientError as exc:
            self.notify(_lines(name, exc), title="Scale refused", severity="error", markup=False)
            if isinstance(exc, ApiError) and exc.status in (400, 422):
                self._ask_scale(deployment, value=str(count), problem=_lines(name, exc))
            return
        self.notify(f"{name}: {count} replica(s) (generation {result['generation']})", markup=False)
        self._load()

    def action_undo(self) -> None:
        """Roll the highlighted deployment back to its previous template, after a confirmation."""
        deployment = self._highlighted_deployment()
        if deployment is None:
            return
        name, history = str(deployment["name"]), deployment.get("history") or []
        if not history:
            self.notify(f"{name} has no earlier template to go back to.", severity="warning", markup=False)
            return
        previous = history[0]
        source = previous.get("source", {})
        body = (
            f"{name} goes back to template {previous.get('hash', '?')} "
            f"({source.get('describe') or source.get('model', '?')}), from {deployment['template']['hash']}. "
            "Its replicas are replaced one by one, each new one ready before an old one drains."
        )
        self.app.push_screen(
            ConfirmModal(f"Roll {name} back?", body, confirm="Roll back"),
            _if_confirmed(lambda: self._undo(name)),
        )

    @work(group="deployment-actions", exit_on_error=False)
    async def _undo(self, name: str) -> None:
        client = self.console.client
        assert isinstance(client, DeploymentSource)
        try:
            result = await client.rollout_undo(name)
        except ClientError as exc:
            self.notify(_lines(name, exc), title="Rollout undo refused", severity="error", markup=False)
            return
        message = f"{name}: back to template {result['template']['hash']} (generation {result['generation']})"
        self.notify(message, markup=False)
        self._load()

    def action_delete(self) -> None:
        """Delete the highlighted deployment, after a confirmation."""
        deployment = self._highlighted_deployment()
        if deployment is None:
            return
        name = str(deployment["name"])
        count = len((deployment.get("status") or {}).get("replicas", []))
        body = f"Its {count} replica(s) drain, then are torn down; then {name} goes."
        self.app.push_screen(
            ConfirmModal(f"Delete {name}?", body, confirm="Delete"),
            _if_confirmed(lambda: self._delete(name)),
        )

    @work(group="deployment-actions", exit_on_error=False)
    async def _delete(self, name: str) -> None:
        client = self.console.client
        assert isinstance(client, DeploymentSource)
        try:
            await client.delete_deployment(name)
        except ClientError as exc:
            self.notify(_lines(name, exc), title="Delete refused", severity="error", markup=False)
            return
        self.notify(f"{name}: deleting (its replicas drain, then are torn down)", markup=False)
        self._load()
