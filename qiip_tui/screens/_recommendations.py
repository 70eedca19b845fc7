"""What fits a host: llmfit's recommendations for the host a node runs on, ranked, each marked when the daemon's
catalog already holds it (`GET /admin/nodes/{host}/recommendations`).

The daemon runs llmfit on the host over SSH; the first run copies llmfit there, so an answer can take a while. A
hardware profile (llmfit's `--profile`, e.g. `rtx-4090`) scores another machine instead of the host's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import Header, Input, Label, Static

from qiip_core.client import ClientError
from qiip_tui._key_router import focus_now
from qiip_tui._recommendations import RECOMMENDATION_COLUMNS, hardware_line, recommendation_rows
from qiip_tui._types import RecommendationSource
from qiip_tui.screens._base import ConsoleScreen
from qiip_tui.widgets import ConsoleInput, ConsoleTable, KeyFooter

if TYPE_CHECKING:
    from qiip_core.recommendations import HostRecommendations

__all__ = ["RECOMMENDATIONS_NOT_AVAILABLE", "RecommendationsScreen"]

RECOMMENDATIONS_NOT_AVAILABLE = (
    "This daemon has no recommendations API (/admin/nodes/{host}/recommendations); upgrade it to see what fits a host."
)
"""What the screen says when the client cannot ask for recommendations."""


class RecommendationsScreen(ConsoleScreen[None]):
    """llmfit's recommendations for one host.

    Args:
        host: the host name or address, as the daemon's provisioning reaches it over SSH.
        limit: how many recommendations to ask for.
    """

    AUTO_FOCUS = "#recommendations"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+r", "run", "Run again"),
        Binding("slash", "profile", "Profile"),
        Binding("escape,q", "back", "Back"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | ctrl+r | Ask llmfit again. |
    | / | Type a hardware profile to score instead of the host (empty: the host); Enter runs it. |
    | escape, q | Back to the node. |
    """

    def __init__(self, host: str, *, limit: int = 20) -> None:
        super().__init__()
        self.host = host
        self.limit = limit
        self.found: HostRecommendations | None = None
        """The last answer, None before the first."""

    def compose(self) -> ComposeResult:
        yield Header()
        yield Label(f"What fits {self.host}", classes="section")
        yield Static("", id="recommendations-status", markup=False)
        yield ConsoleInput(placeholder="hardware profile (empty: the host itself)", id="profile", compact=True)
        yield ConsoleTable(id="recommendations", cursor_type="row", zebra_stripes=True)
        yield KeyFooter()

    def on_mount(self) -> None:
        self.query_one("#profile", Input).display = False
        table = self.query_one("#recommendations", ConsoleTable)
        table.add_columns(*RECOMMENDATION_COLUMNS)
        self.action_run()

    def _status(self, text: str) -> None:
        self.query_one("#recommendations-status", Static).update(text)

    def action_run(self) -> None:
        """Ask the daemon for the host's recommendations (with the profile typed, if any)."""
        profile = self.query_one("#profile", Input).value.strip() or None
        self._fetch(profile)

    def action_profile(self) -> None:
        """Show the profile field and put the cursor there."""
        field = self.query_one("#profile", Input)
        field.display = True
        focus_now(field)

    @on(Input.Submitted, "#profile")
    def _profile_submitted(self) -> None:
        focus_now(self.query_one("#recommendations", ConsoleTable))
        self.action_run()

    @work(exclusive=True, group="recommendations", exit_on_error=False)
    async def _fetch(self, profile: str | None) -> None:
        client = self.console.client
        if not isinstance(client, RecommendationSource):
            self._status(RECOMMENDATIONS_NOT_AVAILABLE)
            return
        scored = f"profile {profile}" if profile else self.host
        self._status(f"Running llmfit for {scored}… (the first run on a host copies llmfit there)")
        try:
            found = await client.recommendations(self.host, profile=profile, limit=self.limit)
        except ClientError as exc:  # the daemon's reason: SSH refused, llmfit failed, an unknown profile, a deadline
            self._status(f"No recommendations for {scored}: {exc}")
            return
        self.found = found
        self._show(found)

    def _show(self, found: HostRecommendations) -> None:
        table = self.query_one("#recommendations", ConsoleTable)
        table.clear()
        rows = recommendation_rows(found)
        for row in rows:
            table.add_row(*row)
        held = sum(1 for row in rows if row[-1] in ("in catalog", "GGUF in catalog"))
        summary = f"{len(rows)} recommended, {held} already in the catalog" if rows else "llmfit recommends nothing"
        self._status(f"{hardware_line(found)}\n{summary}")

    def action_back(self) -> None:
        """Back to the node."""
        self.dismiss()
