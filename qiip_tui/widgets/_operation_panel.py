"""The state of the last background operation (drain, remove, relaunch) started on a node."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar

from qiip_core.client import OperationInfo

__all__ = ["OperationPanel"]


class OperationPanel(Horizontal):
    """`relaunch op_1f…: running — draining` with a bar that runs until the operation ends.

    Hidden until the owner calls `show()`.
    """

    DEFAULT_CSS = """
    OperationPanel {
        height: 1;
        display: none;
        &.-shown { display: block; }
        & Label { width: 1fr; }
        & ProgressBar { width: 22; }
        & Bar { width: 16; }
        &.-failed Label { color: $text-error; }
        &.-succeeded Label { color: $text-success; }
    }
    """

    def compose(self) -> ComposeResult:
        yield Label("")
        yield ProgressBar(total=None, show_eta=False, show_percentage=False)

    def show(self, operation: OperationInfo) -> None:
        """Show an operation's state and its latest log line."""
        self.add_class("-shown")
        self.set_class(operation.state == "failed", "-failed")
        self.set_class(operation.state == "succeeded", "-succeeded")
        last = operation.log[-1].get("message", "") if operation.log else ""
        detail = operation.error if operation.state == "failed" and operation.error else last
        text = Text(f"{operation.kind} {operation.id}: {operation.state}")
        if detail:
            text.append(f" — {detail}")
        self.query_one(Label).update(text)
        bar = self.query_one(ProgressBar)
        if operation.state == "running":
            bar.update(total=None)
        else:
            bar.update(total=1, progress=1)
