"""The key bar at the foot of every screen: Textual's `Footer`, rebuilt only when what it shows changes."""

from __future__ import annotations

from collections.abc import Hashable

from textual.app import ComposeResult
from textual.widgets import Footer


class KeyFooter(Footer):
    """Textual's `Footer`, which rebuilds its keys only when the keys it would show differ from those it shows.

    Textual's own footer recomposes (one new `FooterKey` per binding, each styled) on every
    `Screen.bindings_updated_signal`, and a screen sends one on mount, on every focus move and on every change of the
    screen stack, most of which leave its keys as they were: eight rebuilds a screen on average in the console's
    pictures. This one compares what it would show (each shown binding's key, label, action, enabled state and tooltip,
    its group, and the command palette's key) with what it last built and skips the rebuild when they are equal.
    Its compact state is bound to each key and needs no rebuild.

    Relies on `Footer._bindings_ready` of textual 8.2 (the pin in pyproject.toml).
    """

    _shown: Hashable = None
    """What the last compose drew (`_showing()`), or None before the first."""

    def compose(self) -> ComposeResult:
        self._shown = self._showing()
        yield from super().compose()

    async def recompose(self) -> None:
        """Rebuild the keys if they changed since the last compose (Textual calls this after the bindings change)."""
        if self.is_attached and self._showing() == self._shown:
            return
        await super().recompose()

    def _showing(self) -> Hashable:
        """What a compose now would draw: None until the screen's bindings are ready (a compose draws nothing)."""
        if not self._bindings_ready:
            return None
        app = self.app
        keys = tuple(
            (
                binding.key,
                app.get_key_display(binding),
                binding.description,
                binding.action,
                enabled,
                tooltip,
                None if binding.group is None else (binding.group.description, binding.group.compact),
            )
            for _node, binding, enabled, tooltip in self.screen.active_bindings.values()
            if binding.show
        )
        palette = self.show_command_palette and app.ENABLE_COMMAND_PALETTE
        palette_binding = self.screen.active_bindings.get(app.COMMAND_PALETTE_BINDING) if palette else None
        if palette_binding is not None:
            _node, binding, enabled, _tooltip = palette_binding
            return keys, (binding.key, app.get_key_display(binding), binding.description, enabled, binding.tooltip)
        return keys, None
