"""The download dialog of the models screen: which repository (and revision) the daemon should fetch from the hub.

It only asks; the models screen confirms and starts the download (`POST /admin/models/download`), and the daemon
checks the names (a malformed repository id or revision is refused with a one-line reason, shown as a
notification).
"""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from qiip_tui.widgets import ConsoleInput

__all__ = ["DownloadModal", "DownloadRequest"]

DownloadRequest = tuple[str, str | None]
"""`(repo_id, revision)`: the revision None for the repository's default branch."""


class DownloadModal(ModalScreen[DownloadRequest | None]):
    """Ask for a repository id and an optional revision.

    Dismisses with `(repo_id, revision or None)`, or None when the operator cancels. Enter in either field
    submits; an empty repository id keeps the dialog open with a hint.
    """

    KEY_MAP_NAME: ClassVar[str] = "download"
    """What the key map calls this screen."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | enter | Submit (the models screen then asks to confirm). |
    | escape | Cancel. |
    """

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Download a model from the hub", id="question")
            yield ConsoleInput(placeholder="Repository id, ORG/NAME", id="repo-id")
            yield ConsoleInput(placeholder="Revision: branch, tag or commit (default: main)", id="revision")
            yield Label("Enter submits · Esc cancels", id="confirm-keys")
            with Horizontal(id="buttons"):
                yield Button("Cancel", id="cancel", compact=True)
                yield Button("Download", id="submit", variant="primary", compact=True)

    def on_mount(self) -> None:
        self.query_one("#repo-id", Input).focus()

    def action_submit(self) -> None:
        """Dismiss with the request, unless the repository id is empty."""
        repo_id = self.query_one("#repo-id", Input).value.strip()
        revision = self.query_one("#revision", Input).value.strip()
        if not repo_id:
            self.notify("Give a repository id, such as Qwen/Qwen3-8B-GGUF.", severity="warning")
            self.query_one("#repo-id", Input).focus()
            return
        self.dismiss((repo_id, revision or None))

    def action_cancel(self) -> None:
        """Dismiss with None."""
        self.dismiss(None)

    @on(Input.Submitted)
    @on(Button.Pressed, "#submit")
    def _submitted(self) -> None:
        self.action_submit()

    @on(Button.Pressed, "#cancel")
    def _cancelled(self) -> None:
        self.action_cancel()
