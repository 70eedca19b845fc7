"""Keys go to the widget that has the focus when they act, not to the one that had it when they arrived.

Textual hands each key to the widget focused when the app reads it; a key that widget does not use travels back
up to the app, which then runs the binding it finds from the widget focused *now*. When a key moves the focus
(`/` opens the fleet filter, `2` shows the engine-log pane), the keys typed right after it, in the same read,
were already handed to the widget that had the focus: an operator typing `/gpu` fast would run `p` (power) and
`u` (undrain) on the highlighted node instead of filtering. `KeyRouter` remembers where the app handed each key;
one that comes back unused after the focus moved is handed to the widget focused now, as if it had arrived then.
While a screen just pushed has no focus yet (`:` opens the command line), such a key waits for the next refresh,
once, for the screen to focus its field.

The console's own focus moves are immediate (`focus_now`), so that a key right behind the one that moved the
focus already finds it moved; Textual's `Widget.focus()` moves it one message later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from textual import events

if TYPE_CHECKING:
    from textual.app import App
    from textual.widget import Widget

__all__ = ["KeyRouter", "focus_now"]


def focus_now(widget: Widget) -> None:
    """Give `widget` the focus now, not after the messages already queued (as `Widget.focus()` does)."""
    widget.screen.set_focus(widget)


class KeyRouter:
    """Where the app handed each key, to hand a key on when the focus moved under it.

    Args:
        app: the app whose keys are routed; it calls `handed` for each key it reads and `returned` for each key
            that comes back to it unused.
    """

    def __init__(self, app: App[Any]) -> None:
        self._app = app
        # Weak: a key a widget used never comes back, and must not be kept.
        self._handed_to: WeakKeyDictionary[events.Key, Widget | None] = WeakKeyDictionary()

    def handed(self, event: events.Key) -> None:
        """The app read `event` and hands it to the focused widget (`App.on_event`)."""
        self._handed_to[event] = self._app.focused

    def returned(self, event: events.Key) -> bool:
        """`event` came back to the app unused (`App._on_key`).

        Returns:
            True when it was handed on to the widget focused now (the focus moved since it arrived): the app
            runs no binding for it.
        """
        if event not in self._handed_to:
            return False
        handed_to = self._handed_to.pop(event)
        focused = self._app.focused
        if focused is None and handed_to is not None:
            # A screen was pushed and has not focused anything yet.
            self._app.call_after_refresh(self._after_refresh, event)
            return True
        if focused is None or focused is handed_to:
            return False
        self._read_again(event)
        return True

    def _read_again(self, event: events.Key) -> None:
        # As if the app read it now: it is handed to the widget focused now.
        again = events.Key(event.key, event.character)
        again.set_sender(self._app)
        self._app.post_message(again)

    async def _after_refresh(self, event: events.Key) -> None:
        if self._app.focused is not None:
            self._read_again(event)
        else:
            # Still nothing focused: the key acts as it would have, through the bindings of the screen shown.
            await self._app._check_bindings(event.key)
