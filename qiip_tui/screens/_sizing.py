"""The llama.cpp sizing editor: automatic or custom sizing for one node, checked by the core as it is typed,
applied by a relaunch after a confirmation.

The rules are `qiip_core.planner.validate_policy`'s; every field's violations show beside it at once, and Apply
stays disabled while there is one (ctrl+s then says, in one line, what is wrong instead of sending). Under the
form, the core's forecast from the runtime record: the K/V cache in MiB, the memory left free on each device,
and what the automatic policy would pick now.

If the node's runtime record changes while the form has edits (another operator relaunched it, or it rolled
back), the edits are stale: Apply stays disabled until Reset loads the new record.
Dismisses with the relaunch's `OperationInfo`, or None.
"""

from __future__ import annotations

from typing import ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Horizontal, Vertical
from textual.widgets import Button, Header, Input, Label, RadioButton, RadioSet, Select, Static

from qiip_core.client import ApiError, ClientError, NodeInfo, OperationInfo
from qiip_core.planner import Violation
from qiip_tui._fleet import FleetDelta
from qiip_tui._serving import last_healthy_warning
from qiip_tui._sizing import SizingValues, check_sizing, forecast_lines, sizing_preview
from qiip_tui.screens._base import ConsoleScreen
from qiip_tui.screens._confirm import ConfirmModal
from qiip_tui.widgets import ConsoleInput, KeyFooter

__all__ = ["SizingScreen"]

_FIELDS = (
    ("context_per_slot", "Context per slot"),
    ("slots", "Slots"),
    ("cache_type", "K/V cache type"),
    ("fit_target_mib", "Free VRAM target (MiB)"),
)
_CUSTOM_ONLY = ("context_per_slot", "slots", "cache_type")


class SizingScreen(ConsoleScreen[OperationInfo | None]):
    """Edit and apply a node's sizing policy.

    Args:
        node: the node, which must have a llama.cpp runtime record.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+r", "reset", "Reset"),
        Binding("ctrl+s", "apply", "Apply"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | ctrl+s | Apply (asks first). |
    | ctrl+r | Reset the form to the node's current record. |
    | escape | Close without applying. |
    """

    def __init__(self, node: NodeInfo) -> None:
        super().__init__()
        assert node.llamacpp_runtime is not None, "the sizing editor needs a runtime record"
        self.node = node
        self.base = node.llamacpp_runtime
        """The runtime record the form started from."""
        self.values = SizingValues.from_runtime(self.base)
        """What the form holds."""
        self.violations: list[Violation] = []
        """What the core says is wrong with it."""
        self.stale = False
        """The node's record changed under edits; Reset is needed before Apply."""

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="sizing"):
            yield Label(f"Sizing of {self.node.id} ({self.node.model})", id="sizing-title")
            yield Static("", id="stale", markup=False)
            with RadioSet(id="sizing-mode"):
                yield RadioButton("Automatic", id="auto", value=self.values.sizing == "auto")
                yield RadioButton("Custom", id="custom", value=self.values.sizing == "custom")
            with Grid(id="sizing-fields"):
                for field, label in _FIELDS:
                    yield Label(label, classes="field-label")
                    if field == "cache_type":
                        options = [("F16", "f16"), ("Q8_0", "q8_0")]
                        yield Select(options, allow_blank=False, value=self.values.cache_type, id=field, compact=True)
                    else:
                        yield ConsoleInput(getattr(self.values, field), id=field, compact=True, type="text")
                    yield Label("", id=f"{field}-message", classes="violation")
            yield Label("", id="sizing-message", classes="violation")
            yield Static("", id="effective", markup=False)
            yield Static("", id="preview", markup=False)
            with Horizontal(id="sizing-buttons"):
                yield Button("Reset", id="reset", compact=True)
                yield Button("Cancel", id="cancel", compact=True)
                yield Button("Apply", id="apply", variant="warning", compact=True)
        yield KeyFooter()

    def on_mount(self) -> None:
        self.console.fleet_signal.subscribe(self, self._fleet_changed)
        self._refresh_form()

    # -- the form ----------------------------------------------------------------------------------------

    def _load(self, values: SizingValues) -> None:
        self.values = values
        with self.prevent(Input.Changed, Select.Changed, RadioSet.Changed):
            for field in ("context_per_slot", "slots", "fit_target_mib"):
                self.query_one(f"#{field}", Input).value = getattr(values, field)
            self.query_one("#cache_type", Select).value = values.cache_type
            self.query_one(f"#{values.sizing}", RadioButton).value = True
        self._refresh_form()

    def _refresh_form(self) -> None:
        """Check the values with the core and show the verdict, the preview and Apply's state."""
        self.violations = check_sizing(self.values, self.node)
        self._show_violations(self.violations)
        custom = self.values.sizing == "custom"
        for field in _CUSTOM_ONLY:
            self.query_one(f"#{field}").disabled = not custom
        got = self.base.effective
        self.query_one("#effective", Static).update(
            f"Running now: context per slot {got.get('context_per_slot', '?')}, slots {got.get('slots', '?')}, "
            f"K/V {got.get('cache_type_k', '?')}/{got.get('cache_type_v', '?')}, "
            f"aggregate {got.get('aggregate_context', '?')}, training context {got.get('train_context', '?')}"
        )
        preview = [*sizing_preview(self.values, self.base), *forecast_lines(self.values, self.node)]
        self.query_one("#preview", Static).update("\n".join(preview))
        stale = self.query_one("#stale", Static)
        stale.display = self.stale
        if self.stale:
            stale.update(
                "The node's runtime changed while you edited: these edits are stale. Reset (ctrl+r) loads the "
                "new record; Apply stays disabled until then."
            )
        self.query_one("#apply", Button).disabled = bool(self.violations) or self.stale

    def _show_violations(self, violations: list[Violation]) -> None:
        by_field: dict[str, list[str]] = {}
        for violation in violations:
            by_field.setdefault(violation.field, []).append(violation.message)
        for field, _ in _FIELDS:
            self.query_one(f"#{field}-message", Label).update(" ".join(by_field.pop(field, [])))
        # Violations of fields the form has no widget for (sizing, unknown fields) show under the form.
        self.query_one("#sizing-message", Label).update(" ".join(m for ms in by_field.values() for m in ms))

    @on(Input.Changed)
    def _typed(self, event: Input.Changed) -> None:
        if event.input.id:
            self.values = self.values.with_value(event.input.id, event.value)
            self._refresh_form()

    @on(Select.Changed, "#cache_type")
    def _cache_type(self, event: Select.Changed) -> None:
        self.values = self.values.with_value("cache_type", str(event.value))
        self._refresh_form()

    @on(RadioSet.Changed, "#sizing-mode")
    def _mode(self, event: RadioSet.Changed) -> None:
        self.values = self.values.with_value("sizing", event.pressed.id or "auto")
        self._refresh_form()

    # -- the node changing -------------------------------------------------------------------------------

    def _fleet_changed(self, delta: FleetDelta) -> None:
        node = self.console.fleet.nodes.get(self.node.id)
        if self.node.id not in delta.changed or node is None or node.llamacpp_runtime is None:
            return
        if node.llamacpp_runtime == self.base:
            self.node = node
            return
        edited = self.values != SizingValues.from_runtime(self.base)
        self.node, self.base = node, node.llamacpp_runtime
        if edited:
            self.stale = True
            self._refresh_form()
        else:
            self._load(SizingValues.from_runtime(self.base))

    # -- actions -----------------------------------------------------------------------------------------

    def action_reset(self) -> None:
        """Load the node's current record into the form."""
        node = self.console.fleet.nodes.get(self.node.id, self.node)
        if node.llamacpp_runtime is not None:
            self.node, self.base = node, node.llamacpp_runtime
        self.stale = False
        self._load(SizingValues.from_runtime(self.base))

    def action_cancel(self) -> None:
        """Close without applying."""
        self.dismiss(None)

    def action_apply(self) -> None:
        """Ask, then relaunch the node with the form's policy; say why not when the form cannot be sent."""
        refusal = self._refusal()
        if refusal is not None:
            self.query_one("#sizing-message", Label).update(refusal)
            self.notify(refusal, title="Not applied", severity="error")
            return
        policy = self.values.policy()

        def relaunch(answer: bool | None) -> None:
            if answer is not None:
                self._relaunch(policy)

        summary = ", ".join(f"{key} {value}" for key, value in policy.items())
        node = self.console.fleet.nodes.get(self.node.id, self.node)
        warning = last_healthy_warning(node, self.console.fleet.nodes.values())
        self.app.push_screen(
            ConfirmModal(
                f"Relaunch {self.node.id}?",
                f"New sizing: {summary}.\nThe node drains first and restarts; if the new sizing cannot start, "
                "the previous one runs again." + (f"\n\n{warning}" if warning else ""),
                confirm="Relaunch",
            ),
            callback=relaunch,
        )

    def _refusal(self) -> str | None:
        """One line saying why the form cannot be sent (the first problem, naming its field), or None."""
        if self.stale:
            return "Not applied: the node's runtime changed while you edited; Reset (ctrl+r) loads it first."
        if not self.violations:
            return None
        # The first in the form's order, top to bottom, as the operator reads them.
        order = {field: index for index, (field, _) in enumerate(_FIELDS)}
        first = min(self.violations, key=lambda violation: order.get(violation.field, len(order)))
        more = len(self.violations) - 1
        label = dict(_FIELDS).get(first.field, first.field)
        return f"Not applied: {label}: {first.message}" + (f" ({more} more beside their fields)" if more else "")

    @work(exclusive=True, group="relaunch", exit_on_error=False)
    async def _relaunch(self, policy: dict[str, object]) -> None:
        try:
            operation = await self.console.client.relaunch(self.node.id, policy)
        except ApiError as exc:
            if exc.violations:
                self._show_violations([Violation(v.get("field", ""), v.get("message", "")) for v in exc.violations])
            self.notify(exc.message, title="Relaunch refused", severity="error")
            return
        except ClientError as exc:
            self.notify(exc.message, title="Relaunch failed", severity="error")
            return
        self.dismiss(operation)

    @on(Button.Pressed, "#reset")
    def _reset_pressed(self) -> None:
        self.action_reset()

    @on(Button.Pressed, "#cancel")
    def _cancel_pressed(self) -> None:
        self.action_cancel()

    @on(Button.Pressed, "#apply")
    def _apply_pressed(self) -> None:
        self.action_apply()
